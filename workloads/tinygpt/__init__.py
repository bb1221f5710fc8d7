"""The reference GPT workload: a tiny transformer on a synthetic language, trained through
ReCoVer's public API like any user's script (`python -m recover.workloads.tinygpt`)."""
