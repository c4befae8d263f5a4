"""python -m zeroshard COMMAND: the operator's commands.

  plan   which ZeRO stage fits a model on N cards, and what a step moves (zeroshard.planner)
  check  the bandwidth of the collectives between this machine's cards, under torchrun
         (zeroshard.check)
"""

import sys

USAGE = """usage: python -m zeroshard {plan,check} [options]

  plan   which ZeRO stage fits a model on N cards of some memory, and what a step moves
         (python -m zeroshard plan --help)
  check  all-reduce, reduce-scatter and all-gather bandwidth between the cards, under torchrun
         (python -m zeroshard check --help)"""


def _plan(argv):
    from zeroshard.planner.cli import main

    return main(argv)


def _check(argv):
    # Imported on use: `plan` works wherever the planner does, whatever check needs.
    from zeroshard.check import main

    return main(argv)


COMMANDS = {"plan": _plan, "check": _check}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = "a command is needed" if not argv else f"unknown command {argv[0]!r}"
        print(f"{USAGE}\n\npython -m zeroshard: error: {problem}: plan or check", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
