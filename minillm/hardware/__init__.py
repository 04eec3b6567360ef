"""Layer 1: the machine - description, microbenchmarks, the roofline, data-sheet devices, capacity."""
