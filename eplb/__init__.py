"""Expert-parallel load balancing for MoE models: evaluating an expert
placement against recorded loads (``evaluate``) and planning one (``plan``).
Used by the router (placement by expert-load imbalance) and by decode (its
own counts, re-planned)."""
