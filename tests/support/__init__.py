"""What the tests share: paths of the repository, runs of packctl (in a process of its own, in-process
ranks, under mpiexec, with simulated failures), small input tables, the independent contract
checker, and the blocks of docs/ that tests execute as written."""
