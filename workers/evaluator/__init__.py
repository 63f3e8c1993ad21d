"""The held-out evaluator, a worker role (`asyncrl worker eval`): `rows` (the evaluation set, free of torch;
`humaneval`, HumanEval's problems as rows), `scoring` (greedy accuracy, pass@k, maj@k with the rollout engine; also
`asyncrl eval`'s), `worker` (the process that scores the versions a run's launcher queues, on idle cores)."""
