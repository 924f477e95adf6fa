"""Scoring of job outputs against references: per-row metrics and job-level means with bootstrap
intervals (`metrics`), and the bundled evaluation set (`legal_eval`)."""
