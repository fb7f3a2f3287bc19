"""Runs the Python code blocks of the documentation pages (``tests/project/test_docs.py``).

Reads a JSON list of ``[page, [[line, code], ...]]`` from the file named on the command line
and runs each page's blocks in order, in one namespace per page (a page reads like one script,
as a user pastes it), so the imports are paid once for all pages. Prints ``ok PAGE`` per page,
or ``FAILED PAGE:LINE`` and the traceback, and exits 1 if any block failed.
"""

import json
import sys
import traceback

failed = False
for page, blocks in json.load(open(sys.argv[1])):
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        try:
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        except BaseException:  # noqa: BLE001 - every failure is reported, page and line
            failed = True
            print(f"FAILED {page}:{line}\n{traceback.format_exc()}", flush=True)
            break
    else:
        print(f"ok {page}", flush=True)
sys.exit(1 if failed else 0)
