"""The `edl` command (installed with the package):

    edl bin-dir          the folder EDL's binaries (edl-ps, ...) are found in, or how to get them
    edl check JOBFILE    checks a job file (edl-ps job check) and prints the job it describes
"""

from __future__ import annotations

import argparse
import sys

from . import local


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edl", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("bin-dir", help="print the folder EDL's binaries are found in")
    check = sub.add_parser("check", help="check a job file and print the job it describes")
    check.add_argument("jobfile")
    args = ap.parse_args(argv)
    try:
        if args.command == "bin-dir":
            print(local.bin_dir())
        else:
            print(local.check_job(args.jobfile), end="")
    except (FileNotFoundError, local.JobFileError) as e:
        print(f"edl: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
