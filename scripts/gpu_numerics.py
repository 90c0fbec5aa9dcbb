"""bf16 vs f32 numerics of greedy SD on a GPU (`jspec.tools.bench.numerics`):

    python3 scripts/gpu_numerics.py [--pairs 'random damped 7B,zoo text'] [--out bench_out]
    python3 scripts/gpu_numerics.py --quick          # CPU smoke run, tiny random pair (its numbers mean nothing)
"""
from jspec.tools.bench.numerics import main

if __name__ == "__main__":
    main()
