"""Cost models: compute, communication and memory, all analytic and free of torch."""
