import json
import sys

from zeroedge.device.probe import probe

json.dump(probe(root=sys.argv[1] if len(sys.argv) > 1 else None), sys.stdout, indent=2, sort_keys=True)
print()
