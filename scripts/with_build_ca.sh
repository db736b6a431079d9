#!/usr/bin/env bash
# Runs a command (pip, or a script that calls pip) inside `docker build`, with
# the CA of a TLS proxy when the build was given one as the secret `ca`:
#   docker build --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt ...
# A secret is mounted for one RUN only, so the CA never stays in a layer.
# Before the command, one request to the package index: a proxy whose CA the
# build lacks then fails here with one line saying what to pass, not deep in
# pip's retries.
set -euo pipefail
if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi
python3 - "${PIP_INDEX_URL:-https://pypi.org/simple}" <<'PY'
import os
import ssl
import sys
import urllib.error
import urllib.request

url = sys.argv[1].rstrip("/") + "/pip/"
context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT"))
try:
    urllib.request.urlopen(url, context=context, timeout=60).close()
except urllib.error.HTTPError:
    pass                                   # it answered over verified TLS: all this asks
except (ssl.SSLError, urllib.error.URLError) as exc:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ssl.SSLError):
        sys.exit(f"TLS to {url} fails verification ({reason.__class__.__name__}): behind a TLS "
                 "proxy, give the build its CA: docker build --secret id=ca,src=CA_BUNDLE "
                 "(make image passes pip's own `cert` setting)")
    sys.exit(f"cannot reach the package index {url}: {reason}")
PY
exec "$@"
