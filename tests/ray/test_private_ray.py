"""Without --address raydl starts a private local Ray, without a dashboard, even when another Ray runs here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, ray
from raydl.driver.ray_trainer import connect
connect(None, {})
node = ray.nodes()[0]
print(json.dumps({"node": node["NodeID"], "nodes": len(ray.nodes()),
                  "webui": ray._private.worker.global_worker.node.address_info.get("webui_url")}))
"""


@pytest.mark.slow
def test_local_ray_is_private_and_has_no_dashboard(ray_session):
    # The session's Ray is "another Ray on this machine": plain ray.init() would have joined it.
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["nodes"] == 1 and not probe["webui"], out.stderr[-2000:]
    assert probe["node"] != ray_session.nodes()[0]["NodeID"]
