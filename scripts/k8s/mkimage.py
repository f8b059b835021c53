#!/usr/bin/env python3
"""Make a one-layer container image as a ``docker save`` tarball, with no registry and no docker.

usage: mkimage.py NAME:TAG ROOTFS OUT.tar [--entrypoint JSON] [--cmd JSON]
then:  ctr -n k8s.io images import OUT.tar

The layer is ROOTFS as a tar (every file owned by root, links kept); the image config names it by the
layer's sha256 (its diff_id), and manifest.json ties the tag to both.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile
import time


def layer(rootfs: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder, subfolders, files in os.walk(rootfs):
            subfolders.sort()
            for name in [*subfolders, *sorted(files)]:
                path = os.path.join(folder, name)
                info = tar.gettarinfo(path, arcname=os.path.relpath(path, rootfs))
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                if info.isfile():
                    with open(path, "rb") as data:
                        tar.addfile(info, data)
                else:
                    tar.addfile(info)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("rootfs")
    parser.add_argument("out")
    parser.add_argument("--entrypoint", default="null")
    parser.add_argument("--cmd", default="null")
    args = parser.parse_args()
    data = layer(args.rootfs)
    diff_id = "sha256:" + hashlib.sha256(data).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": {
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                "Entrypoint": json.loads(args.entrypoint),
                "Cmd": json.loads(args.cmd),
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = diff_id.removeprefix("sha256:") + "/layer.tar"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [args.name], "Layers": [layer_name]}]).encode()
    with tarfile.open(args.out, "w") as out:
        for name, content in ((config_name, config), (layer_name, data), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mtime = int(time.time())
            out.addfile(info, io.BytesIO(content))


if __name__ == "__main__":
    main()
