"""What every family is built from: configs, the KV cache and recurrent state, layers, experts, vision blocks and
the parameter-name transforms, the safetensors format. Imports nothing else of `ports`."""
