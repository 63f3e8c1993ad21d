"""`asyncrl chaos`: fault injection (SIGKILL of each role at random moments) and poison (bad bytes on every topic,
bad dataset rows) against short real runs, each read back from its own topics. `cli.py` is the standard library
only, so `asyncrl --help` stays instant; the rest imports what it drives."""
