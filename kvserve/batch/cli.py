"""`kvserve batch submit|status|list|cancel|download`: the batch API from the shell, over HTTP to a running
server (the same endpoints the openai client uses). With the server's --config (or --home), its address and
its development token are the ones that server uses."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.cli import add_store_arguments

    parser.add_argument("--url", default=os.environ.get("KVSERVE_URL"),
                        help="the server (default: $KVSERVE_URL, else [server] host and port of --config)")
    parser.add_argument("--token", default=None, help="API token (default: $KVSERVE_API_KEY, or the dev token)")
    add_store_arguments(parser)
    sub = parser.add_subparsers(dest="batch_cmd", required=True)
    s = sub.add_parser("submit", help="upload a JSONL file and start a batch; a progress bar until it ends")
    s.add_argument("file")
    s.add_argument("--endpoint", default="/v1/chat/completions")
    s.add_argument("--window", default="24h", help="completion window (default 24h)")
    s.add_argument("--no-wait", action="store_true", help="print the batch id and return")
    st = sub.add_parser("status", help="one batch")
    st.add_argument("batch_id")
    sub.add_parser("list", help="recent batches")
    c = sub.add_parser("cancel", help="stop a batch: pending lines are cancelled, running ones aborted")
    c.add_argument("batch_id")
    d = sub.add_parser("download", help="a batch's output (or --errors: error) file")
    d.add_argument("batch_id")
    d.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    d.add_argument("--errors", action="store_true")
    parser.set_defaults(func=run)


def _token(args, home: str | None) -> str:
    if args.token or os.environ.get("KVSERVE_API_KEY"):
        return args.token or os.environ["KVSERVE_API_KEY"]
    from kvserve.config import kvserve_home

    path = kvserve_home(home) / "dev-token"
    if path.is_file():
        return path.read_text().strip()
    raise SystemExit("kvserve batch: no token (--token, $KVSERVE_API_KEY, or the dev token of `kvserve serve`)")


def _line(b: dict) -> str:
    c = b["request_counts"]
    return (f"{b['id']}  {b['status']:<11} {c['completed']}/{c['total']} done, {c['failed']} failed"
            + (f"  output {b['output_file_id']}" if b.get("output_file_id") else "")
            + (f"  errors {b['error_file_id']}" if b.get("error_file_id") else ""))


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvserve.cli import server_config

    cfg = server_config(args)
    client = httpx.Client(base_url=args.url or f"http://{cfg.host}:{cfg.port}",
                          headers={"Authorization": f"Bearer {_token(args, cfg.home)}"}, timeout=120)

    def call(method: str, path: str, **kw) -> dict:
        r = client.request(method, path, **kw)
        if r.status_code >= 400:
            err = r.json().get("error", {}) if "json" in r.headers.get("content-type", "") else {"message": r.text}
            raise SystemExit(f"kvserve batch: {r.status_code} {err.get('code') or ''}: {err.get('message')}")
        return r.json()

    if args.batch_cmd == "submit":
        path = Path(args.file)
        f = call("POST", "/v1/files", files={"file": (path.name, path.read_bytes())}, data={"purpose": "batch"})
        b = call("POST", "/v1/batches", json={"input_file_id": f["id"], "endpoint": args.endpoint,
                                              "completion_window": args.window})
        if b["status"] == "failed":
            for e in b["errors"]["data"]:
                print(f"line {e['line']}: {e['code']}: {e['message']}", file=sys.stderr)
            print(_line(b))
            return 1
        print(f"batch {b['id']} of {b['request_counts']['total']} lines from {f['id']}", flush=True)
        if args.no_wait:
            return 0
        from tqdm import tqdm

        with tqdm(total=b["request_counts"]["total"], unit="line", desc=b["id"][:18]) as bar:
            while b["status"] not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(0.5)
                b = call("GET", f"/v1/batches/{b['id']}")
                c = b["request_counts"]
                bar.update(c["completed"] + c["failed"] - bar.n)
                bar.set_postfix(status=b["status"], failed=c["failed"])
        print(_line(b))
        return 0 if b["status"] == "completed" else 1
    if args.batch_cmd == "status":
        print(_line(call("GET", f"/v1/batches/{args.batch_id}")))
        return 0
    if args.batch_cmd == "list":
        for b in call("GET", "/v1/batches", params={"limit": 20})["data"]:
            print(_line(b))
        return 0
    if args.batch_cmd == "cancel":
        print(_line(call("POST", f"/v1/batches/{args.batch_id}/cancel")))
        return 0
    b = call("GET", f"/v1/batches/{args.batch_id}")
    fid = b["error_file_id" if args.errors else "output_file_id"]
    if not fid:
        raise SystemExit(f"kvserve batch: batch {args.batch_id} has no {'error' if args.errors else 'output'} file "
                         f"(status {b['status']})")
    data = client.get(f"/v1/files/{fid}/content").content
    if args.output:
        Path(args.output).write_bytes(data)
        print(f"wrote {len(data)} bytes to {args.output}")
    else:
        sys.stdout.write(data.decode())
    return 0
