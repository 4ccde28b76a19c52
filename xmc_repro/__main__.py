"""`python -m xmc_repro`: the command line, defined in xmc_repro/entry.py (a module of its own, not `__main__`,
so that a launcher pickles its task by reference and its workers import the module's setup)."""

from xmc_repro.entry import main

if __name__ == "__main__":
    main()
