"""Client side of a ReCoVer job, shared by the command line (`recover.cli`) and the
benchmarks (`recover.bench`): connecting to a controller, and handing a job to a child
`recover` process. It imports neither of them, so that neither depends on the other."""
