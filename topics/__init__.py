"""Everything between the workers and the broker: the only package that imports aiokafka.

`transport` (the interface every worker talks to: outbox, inboxes, dead letters, commits, the weights
follower), its implementations `kafka` (any Kafka-protocol broker) and `memory` (one process), `names` (topic
roles and settings), `clients` (aiokafka producers and consumers), `admin` (topic creation and committed
offsets), `readers` (read a whole topic), `assembly` (segments joined into trajectories), `tracing` (trace
context in headers), `export` (a run's topics to a file and back), `inspect` (a broker's topics from outside a
run), `broker` (the embedded broker).
"""
