"""One module per `asyncrl` command: `add_parser(commands)` declares its options and sets its handler as the
parsed arguments' `handle`. Only argparse and the standard library are imported here, so that `asyncrl --help`
is instant; a handler imports what its command needs when it runs."""
