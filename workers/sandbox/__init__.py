"""Model-written code, run where it can do no harm: the bubblewrap sandbox (`bwrap.run_python`), its warm
server (`zygote`), the per-execution memory bound and kill (`cgroup`), and the verdicts of a program's tests
computed on the host (`code`). Rewards, tasks and tool workflows all run code through here."""
