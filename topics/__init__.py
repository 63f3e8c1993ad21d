"""Everything between the workers and the broker.

`names` (topic roles and settings), `clients` (producers, consumers, send),
`admin` (topic creation), `readers` (read a whole topic), `dead_letter`
(decode or hand bad bytes to `dead-letter`), `commits` (what a worker may
commit), `broker` (the embedded broker).
"""
