"""The pieces of benchmarks/summarize.py's report, one job per module: results (reading the files), values
(formatting), header, run_sections and kernel_sections (one section per file), targets, decisions."""
