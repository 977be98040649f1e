"""Side-by-side benchmarks: slotserve's engine against HF transformers on the same work.

``python -m benchmarks`` builds a seeded workload, runs every selected system on it one
after the other (each in a fresh process, so peak RSS is its own), profiles the engine
step, and writes a table, a JSON file with every number, and PNG plots.
"""
