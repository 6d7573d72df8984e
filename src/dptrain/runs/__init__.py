"""A run from a config to a run directory: the job and its loop, the directory, resume, the printed report and the
process's memory settings."""
