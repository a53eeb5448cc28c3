"""Decode GEMM plans by weight shape (benchmarks/gemm_sweep.py ``--write-table``
writes this module from what it measured): {(K, N, rows bucket): GemmPlan
fields}. Empty: the 64-row rule of ``engine.triton_gemm.plan_16bit`` for all."""

TABLE: dict[tuple[int, int, int], dict[str, object]] = {
}
