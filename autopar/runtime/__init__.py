"""Running a plan: the per-rank module, its optimizer and the local launcher."""
