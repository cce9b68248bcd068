"""Fetch onnxruntime's C / C++ API headers for scripts/build_ortops: Debian's libonnxruntime-dev
package, pinned by version and SHA-256, unpacked in memory; only its regular header files are
written, flat, into the folder given. Nothing of it is installed or committed.

    python3 ortops/fetch_headers.py DEST
"""
import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

URL = ("http://deb.debian.org/debian/pool/main/o/onnxruntime/"
       "libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb")
SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
HEADERS = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h",
           "onnxruntime_float16.h", "onnxruntime_session_options_config_keys.h",
           "onnxruntime_run_options_config_keys.h")


def ar_members(blob: bytes):
    """(name, bytes) of a Unix ar archive (a .deb)."""
    if blob[:8] != b"!<arch>\n":
        raise ValueError("not a .deb (ar) archive")
    at = 8
    while at + 60 <= len(blob):
        head = blob[at:at + 60]
        name, size = head[:16].decode().strip().rstrip("/"), int(head[48:58].decode().strip())
        yield name, blob[at + 60:at + 60 + size]
        at += 60 + size + (size & 1)


def main(dest: str) -> int:
    try:
        with urllib.request.urlopen(URL, timeout=120) as r:
            blob = r.read()
    except OSError as e:
        print(f"fetch_headers: cannot download {URL} ({e}); pass --ort-include DIR to scripts/build_ortops",
              file=sys.stderr)
        return 2
    if hashlib.sha256(blob).hexdigest() != SHA256:
        print(f"fetch_headers: {URL} does not match its pinned SHA-256; not used", file=sys.stderr)
        return 2
    data = next((b for n, b in ar_members(blob) if n.startswith("data.tar")), None)
    if data is None:
        print("fetch_headers: the package holds no data.tar", file=sys.stderr)
        return 2
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    found = 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            name = m.name.rsplit("/", 1)[-1]
            if m.isfile() and m.name.startswith("./usr/include/onnxruntime/") and name in HEADERS:
                (out / name).write_bytes(tar.extractfile(m).read())
                found += 1
    if found != len(HEADERS):
        print(f"fetch_headers: {found} of {len(HEADERS)} headers found in the package", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
