"""Per-attempt token and cost accounting: rows, miss reasons, prices, the report (torch-free)."""
