"""The curation stages, one module each, in the order they run: score, filter, label, pair
(and export, which writes datasets for other trainers). Each declares STAGE, READS, WRITES,
CONFIG, columns(cfg) and one pure transform(tables, cfg); runner.run_stage runs any of them
(see runner.py and docs/ARCHITECTURE.md, "Stages: what reads and writes what")."""
