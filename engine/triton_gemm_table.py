"""Decode GEMM plans by weight shape, as benchmarks/gemm_sweep.py measured them
(NVIDIA H200, copy 4158 GB/s, weights kn):
{(K, N, rows bucket): GemmPlan fields}, each faster than the 64-row rule's
plan at the bucket's own row count with every row's bits kept (checked
against a 2,048-row call there). Written by ``python3 -m
benchmarks.gemm_sweep --write-table``; docs/BENCHMARKS.md, issue 21.
"""

TABLE: dict[tuple[int, int, int], dict[str, object]] = {
    # 30.5 us (0.925 of the copy) against 31.4 (shipped: swap W64 w4 s10 k64)
    (14336, 4096, 32):
        {"bm": 64, "bn": 64, "warps": 4, "stages": 6,
         "persistent": True, "swap": True, "bk": 128},
    # 31.2 us (0.904 of the copy) against 38.8 (shipped: 64x64 w4 s6 k128)
    (14336, 4096, 64):
        {"bm": 64, "bn": 64, "warps": 4, "stages": 6,
         "persistent": True, "swap": True, "bk": 128},
    # 15.0 us (0.806 of the copy) against 15.9 (shipped: swap W64 w4 s10 k64)
    (4096, 6144, 32):
        {"bm": 64, "bn": 64, "warps": 4, "stages": 4,
         "persistent": False, "swap": True, "bk": 128},
    # 16.4 us (0.740 of the copy) against 16.7 (shipped: 64x64 w4 s6 k128)
    (4096, 6144, 64):
        {"bm": 64, "bn": 64, "warps": 4, "stages": 8,
         "persistent": False, "swap": False, "bk": 64},
    # 10.6 us (0.758 of the copy) against 13.0 (shipped: 64x64 w4 s6 k128)
    (4096, 4096, 64):
        {"bm": 64, "bn": 64, "warps": 4, "stages": 6,
         "persistent": True, "swap": True, "bk": 128},
    # 55.7 us (1.014 of the copy) against 60.3 (shipped: swap W128 w4 s4 k64)
    (4096, 28672, 32):
        {"bm": 64, "bn": 256, "warps": 8, "stages": 3,
         "persistent": False, "swap": True, "bk": 64},
    # 58.1 us (0.973 of the copy) against 61.9 (shipped: swap W128 w4 s4 k64)
    (4096, 28672, 64):
        {"bm": 64, "bn": 128, "warps": 8, "stages": 4,
         "persistent": False, "swap": True, "bk": 128},
}
