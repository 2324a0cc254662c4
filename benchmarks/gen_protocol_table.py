"""Print the reference protocol's transition tables (Markdown), rendered from
its rule tables (pdproto/protocol/_push_pull.py).  docs/protocol.md embeds
this output between the GENERATED markers; tests/test_reference.py checks
that the two agree.  Run: ``python benchmarks/gen_protocol_table.py``."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pdproto.protocol import transition_table_markdown  # noqa: E402
from pdproto.spec import POLICIES  # noqa: E402

if __name__ == "__main__":
    for policy in POLICIES:
        print(f"<!-- BEGIN GENERATED TABLE {policy} -->")
        print(transition_table_markdown(policy), end="")
        print(f"<!-- END GENERATED TABLE {policy} -->")
        print()
