"""The suite. unit/ mirrors the source tree (schemas, topics, workers, pipeline) and starts no process: a test
that needs a real process, broker, sandbox or cluster is in integration/; e2e/ runs whole pipelines; contract/
holds what every plug-in (transport, engine, task, workflow) must satisfy. factories.py builds the messages and
the tiny model the tests share; `make system-deps` installs the Debian packages some tests run."""
