"""One conversation sharded over the ranks of an MLX distributed job: launch detection, sharding,
the control channel and the job (see job.py). Imports no MLX."""
