"""The `kvserve` command: serve | models | generate | chat | tenants | bench.

Thin on purpose: each subcommand parses its arguments and calls into the package.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time


# ---- serve --------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.config import ServerConfig
    from kvserve.server.app import create_app, make_server
    from kvserve.server.auth import ensure_dev_tenant
    from kvserve.store import Store

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ServerConfig.from_toml(args.config, host=args.host, port=args.port, stall_timeout_s=args.stall_timeout,
                                 shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level,
                                 region=args.region, **({"home": args.home} if args.home else {}))
    app = create_app(cfg)
    state = app.state.kv
    state.home.mkdir(parents=True, exist_ok=True)
    with Store(state.db_path) as store:
        token, created = ensure_dev_tenant(store, state.home)
    base = f"http://{cfg.host}:{cfg.port}"
    first = cfg.models[0].id if cfg.models else "MODEL"
    shown = token or "$KVSERVE_TOKEN"
    lines = [f"kvserve: serving {', '.join(m.id for m in cfg.models)} on {base} (models load in the background; "
             f"GET {base}/ready says when)",
             f"  data directory: {state.home}"]
    if token and created:
        lines.append(f"  created development tenant 'dev'; its token (kept in {state.home / 'dev-token'}, mode 0600):")
    elif token:
        lines.append(f"  development token (from {state.home / 'dev-token'}):")
    else:
        lines.append("  tenants exist: use one of their tokens (create one: kvserve tenants create NAME)")
    if token:
        lines.append(f"  {token}")
    lines += ["  try:",
              f"  curl -N {base}/v1/chat/completions -H 'Authorization: Bearer {shown}' "
              f"-H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{first}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
              f"\"stream\": true}}'"]
    print("\n".join(lines), flush=True)
    make_server(app, cfg.host, cfg.port, args.log_level).run()
    return 0


def cmd_serve_fleet(args: argparse.Namespace) -> int:
    """`kvserve serve --fleet`: the same API from a gateway over replica pools on Ray Serve (fleet/deploy.py)."""
    from pathlib import Path

    from kvserve.config import DEFAULT_CONFIG, ServerConfig, kvserve_home
    from kvserve.fleet import deploy
    from kvserve.server.auth import ensure_dev_tenant
    from kvserve.store import Store, store_location

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ServerConfig.from_toml(args.config, host=args.host, port=args.port, stall_timeout_s=args.stall_timeout,
                                 shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level,
                                 region=args.region)
    ray_address = args.ray_address or cfg.regions.ray_address or None  # the flag, else the region's entry
    with Store(store_location(cfg.db_path, cfg.home)) as store:
        token, _ = ensure_dev_tenant(store, kvserve_home(cfg.home))
    print(f"kvserve fleet: starting replica pools for {', '.join(m.id for m in cfg.models)} on Ray "
          f"({ray_address or 'a local instance'}); the gateway answers on http://{cfg.host}:{cfg.port} "
          f"once they are up", flush=True)
    try:
        deploy.start(cfg, Path(args.config or DEFAULT_CONFIG).read_text(), ray_address)
    except deploy.FleetError as e:
        print(f"kvserve fleet: {e}", file=sys.stderr)
        return 1
    print(f"kvserve fleet: serving on http://{cfg.host}:{cfg.port}" + (f"; development token: {token}" if token else "")
          + "\n  kvserve fleet status | kvserve fleet apply NEW.toml; Ctrl-C stops the fleet", flush=True)
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # SIGTERM (and SIGINT) stop the fleet: Serve drains, Ray stops
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from ray import serve

        print("kvserve fleet: stopping", flush=True)
        serve.shutdown()
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvserve.fleet import deploy, status

    try:
        if args.fleet_cmd == "apply":
            for line in deploy.apply(Path(args.config).read_text(), args.ray_address, region=args.region) \
                    or ["no change"]:
                print(line)
            return 0
        print(status.render(status.collect(args.ray_address, args.url)))
        return 0
    except deploy.FleetError as e:
        print(f"kvserve fleet: refused: {e}", file=sys.stderr)
        return 1


# ---- models -------------------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    from kvserve.config import ServerConfig

    cfg = ServerConfig.from_toml(args.config)
    width = max([len(m.id) for m in cfg.models] + [2])
    print(f"{'ID':<{width}}  {'ROLE':<8} SOURCE")
    for m in cfg.models:
        print(f"{m.id:<{width}}  {m.role or '-':<8} {m.source}")
    return 0


# ---- generate / chat (offline engine) ------------------------------------------------------------


def _offline_engine(model: str, config_path: str | None, engine_args: dict):
    """An LLMEngine for a catalog id (from --config or the default models file) or a path."""
    from dataclasses import replace

    from kvserve.config import ServedModel, ServerConfig
    from kvserve.engine.worker.llm_engine import LLMEngine
    from kvserve.models.catalog import resolve_source

    cfg = ServerConfig.from_toml(config_path)
    entry = next((m for m in cfg.models if m.id == model), None)
    if entry is None:
        entry = ServedModel(id=os.path.basename(model.rstrip("/")), source=model)
    entry = replace(entry, engine_args={**entry.engine_args, **{k: v for k, v in engine_args.items() if v is not None}})
    engine_config = entry.engine_config()
    path = resolve_source(entry.source, entry.engine_args.get("install", ""))
    return LLMEngine(replace(engine_config, model=str(path)), model_id=entry.id)


def _stream(engine, out=sys.stdout, **request) -> str:
    """Run one request through the engine's step loop, printing deltas as they arrive; returns the text."""
    rid = engine.core.add_request(engine.request(**request))
    text = ""
    while engine.core.has_unfinished_requests():
        for ro in engine.core.step():
            if ro.request_id != rid:
                continue
            delta = ro.outputs[0].delta_text
            if delta:
                out.write(delta)
                out.flush()
                text += delta
    return text


def _params(args: argparse.Namespace):
    from kvserve.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _offline_engine(args.model, args.config, {"max_model_len": args.max_model_len})
    params = _params(args)
    if args.chat:
        _stream(engine, prompt=None, messages=[{"role": "user", "content": args.prompt}], params=params)
    else:
        _stream(engine, prompt=args.prompt, params=params)
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive REPL (or one message per line of piped stdin); history is kept; /reset, /exit."""
    engine = _offline_engine(args.model, args.config, {"max_model_len": args.max_model_len})
    params = _params(args)
    interactive = sys.stdin.isatty()
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    if interactive:
        print(f"chatting with {args.model}; /reset clears the history, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = _stream(engine, prompt=None, messages=history, params=params)
        except Exception as e:  # e.g. the history outgrew the context
            print(f"\nerror: {e}", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
    return 0


# ---- tenants --------------------------------------------------------------------------------------


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that say where the store is, as `kvserve serve` reads them (store.store_location)."""
    p.add_argument("--config", default=None, help="server TOML whose [server] db_path (an SQLite file or a "
                                                  "postgresql:// URL) or home names the store; else $KVSERVE_DB, "
                                                  "else $KVSERVE_HOME/kvserve.db")
    p.add_argument("--home", default=None, help="data directory (as kvserve serve --home)")


def server_config(args: argparse.Namespace):
    """The server TOML a store-touching command was given (--config, --home), read as `kvserve serve` reads it."""
    from kvserve.config import ServerConfig

    return ServerConfig.from_toml(args.config, home=args.home)


def _store(args: argparse.Namespace):
    from kvserve.store import Store, store_location

    cfg = server_config(args)
    return Store(store_location(cfg.db_path, cfg.home))


def cmd_tenants(args: argparse.Namespace) -> int:
    from kvserve.metering.money import format_money
    from kvserve.store import TenantError

    with _store(args) as store:
        if args.tenants_cmd == "create":
            try:
                _, token = store.create_tenant(args.name, admin=args.admin)
            except TenantError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(f"created tenant {args.name!r}; its API token (shown once, keep it secret):")
            print(token)
            return 0
        if args.tenants_cmd == "list":
            tenants = store.list_tenants()
            if not tenants:
                print("no tenants (create one: kvserve tenants create NAME)")
                return 0
            width = max(len(t.name) for t in tenants)
            print(f"{'NAME':<{width}}  {'STATUS':<8} {'TOKENS':>6}  CREATED")
            for t in tenants:
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t.created_at))
                print(f"{t.name:<{width}}  {'revoked' if t.revoked else 'active':<8} {t.active_tokens:>6}  {created}")
            return 0
        if args.tenants_cmd == "budget":
            if args.clear:
                gone = store.budgets.delete_budget(args.name, args.model or "*")
                print(f"budget of {args.name!r} ({args.model or 'all models'}) " + ("removed" if gone else "not set"))
                return 0 if gone else 1
            if store.get_tenant(args.name) is None:
                print(f"error: no tenant {args.name!r}", file=sys.stderr)
                return 1
            try:
                b = store.budgets.set_budget(args.name, args.amount, args.period, args.model or "*")
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"budget of {b.tenant!r} for {'all models' if b.model == '*' else b.model}: "
                  f"{format_money(b.amount)} per {b.period if b.period != 'none' else 'lifetime (no reset)'}; "
                  f"spent {format_money(b.spent)}, held {format_money(b.reserved)}, left {format_money(b.remaining)}")
            return 0
        if args.tenants_cmd == "limits":
            if store.get_tenant(args.name) is None:
                print(f"error: no tenant {args.name!r}", file=sys.stderr)
                return 1
            try:
                store.rate_limits.set_limits(args.name, args.rpm, args.tpm)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"rate limits of {args.name!r}: " + (
                f"{args.rpm or 'unlimited'} requests and {args.tpm or 'unlimited'} tokens per minute"
                if args.rpm or args.tpm else "none"))
            return 0
        if args.tenants_cmd == "budgets":
            rows = store.budgets.list(args.name)
            if not rows:
                print("no budgets (set one: kvserve tenants budget TENANT AMOUNT --period month)")
                return 0
            print(f"{'TENANT':<20} {'MODEL':<16} {'PERIOD':<6} {'AMOUNT':>14} {'SPENT':>14} {'HELD':>14} {'LEFT':>14}")
            for b in rows:
                print(f"{b.tenant:<20} {b.model:<16} {b.period:<6} " + " ".join(
                    f"{format_money(v):>14}" for v in (b.amount, b.spent, b.reserved, b.remaining)))
            return 0
        if args.tenants_cmd == "revoke":
            if store.revoke_tenant(args.name):
                print(f"revoked tenant {args.name!r} and all its tokens")
                return 0
            print(f"error: no active tenant {args.name!r}", file=sys.stderr)
            return 1
    return 2


def cmd_usage(args: argparse.Namespace) -> int:
    """`kvserve usage`: the usage report (the same rows as GET /v1/usage) as a table, or CSV."""
    from kvserve.metering import reports
    from kvserve.metering.money import format_money

    if args.bucket not in reports.BUCKET_WIDTHS:
        print(f"error: --bucket must be one of {', '.join(reports.BUCKET_WIDTHS)}", file=sys.stderr)
        return 2
    group_by = [g for g in (args.group_by or "").split(",") if g]
    width = reports.BUCKET_WIDTHS[args.bucket]
    now = time.time()
    start = (now // width - args.buckets + 1) * width
    with _store(args) as store:
        try:
            rows = store.usage.buckets(start, now, width, group_by, args.tenant)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    page = reports.page(rows, start, now, args.bucket, group_by, args.buckets)
    if args.csv:
        sys.stdout.write(reports.to_csv(page))
        return 0
    table = [("BUCKET (UTC)", "TENANT", "MODEL", "TIER", "ADAPTER", "REQUESTS", "INPUT", "CACHED", "FROM DISK",
              "FROM HOST", "OUTPUT", "CHARGED", "COST", "ENGINE S")]
    fmt = "%Y-%m-%d %H:%M" if width < 86400 else "%Y-%m-%d"
    for row in reports.flat(page):
        r = dict(zip(reports.COLUMNS, row))
        table.append((time.strftime(fmt, time.gmtime(r["start_time"])), r["tenant"] or "-", r["model"] or "-",
                      r["tier"] or "-", r["adapter"] or "-", str(r["num_model_requests"]), str(r["input_tokens"]),
                      str(r["input_cached_tokens"]), str(r["input_disk_cached_tokens"]),
                      str(r["input_host_cached_tokens"]), str(r["output_tokens"]), format_money(r["amount_usd"]),
                      format_money(r["cost_usd"]), f"{r['engine_seconds']:.2f}"))
    if len(table) == 1:
        print("no usage in this range")
        return 0
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return 0


# ---- bench (placeholder for the load generator) ----------------------------------------------------


def _add_bench(sub) -> None:
    """`kvserve bench ...`: delegates to kvserve.bench.cli (add_arguments(parser), run(args) -> int) when present."""
    parser = sub.add_parser("bench", help="load generator against a running server")
    try:
        from kvserve.bench.cli import add_arguments, run  # type: ignore[import-not-found]
    except ImportError:
        parser.add_argument("rest", nargs=argparse.REMAINDER)
        parser.set_defaults(func=lambda a: (print("kvserve bench: the load generator is not available yet",
                                                  file=sys.stderr), 2)[1])
        return
    add_arguments(parser)
    parser.set_defaults(func=run)


# ---- main ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM serving: paged KV cache, continuous batching, "
                                                                 "tenants, priorities, admission control")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    s.add_argument("--config", help="server TOML ([server] and [[models]]); default: the packaged models file")
    s.add_argument("--host", default=None, help="default 127.0.0.1 (or [server].host)")
    s.add_argument("--port", type=int, default=None, help="default 8000 (or [server].port)")
    s.add_argument("--stall-timeout", type=float, default=None,
                   help="seconds without an engine step while work is pending before /health is 503 (default 30)")
    s.add_argument("--shutdown-timeout", type=float, default=None,
                   help="SIGTERM grace period for running requests, seconds (default 30)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--home", default=None, help="data directory (default [server].home, else $KVSERVE_HOME or "
                                                "~/.kvserve); the store is kvserve.db there unless [server].db_path")
    s.add_argument("--fleet", action="store_true", help="serve through a gateway over replica pools on Ray Serve")
    s.add_argument("--ray-address", default=None, help="with --fleet: join this Ray cluster (default: start one)")
    s.add_argument("--region", default=None, help="this server's region, one of those the [regions] table lists "
                                                  "(the others are its peers)")
    s.set_defaults(func=lambda a: cmd_serve_fleet(a) if a.fleet else cmd_serve(a))

    f = sub.add_parser("fleet", help="the fleet on Ray Serve: status, rolling updates")
    fsub = f.add_subparsers(dest="fleet_cmd", required=True)
    fa = fsub.add_parser("apply", help="apply a new models TOML: new pools warm up, traffic moves, old ones drain")
    fa.add_argument("config")
    fa.add_argument("--ray-address", default="auto")
    fa.add_argument("--region", default=None, help="the fleet's region, where the TOML lists several (as serve's)")
    fs = fsub.add_parser("status", help="replicas, versions, health, load, routing and prefix hit rates")
    fs.add_argument("--ray-address", default="auto")
    fs.add_argument("--url", default=None, help="a gateway's base URL (default: http://[server].host:port)")
    f.set_defaults(func=cmd_fleet)

    m = sub.add_parser("models", help="list the models of the catalog")
    m.add_argument("--config", help="server TOML (default: the packaged models file)")
    m.set_defaults(func=cmd_models)

    def sampling_args(p):
        p.add_argument("--model", required=True, help="catalog id, .gguf path or HF checkpoint directory")
        p.add_argument("--config", help="models TOML (default: the packaged one)")
        p.add_argument("--max-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=0.7)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--max-model-len", type=int, default=None)

    g = sub.add_parser("generate", help="stream one completion to stdout (offline engine)")
    sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat (or one message per line on stdin)")
    sampling_args(c)
    c.add_argument("--system", default=None, help="a system message")
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("tenants", help="manage tenants and their API tokens")
    tsub = t.add_subparsers(dest="tenants_cmd", required=True)
    tc = tsub.add_parser("create", help="create a tenant; prints its token once, alone on the last line")
    tc.add_argument("name")
    tc.add_argument("--admin", action="store_true", help="an admin tenant: every tenant's usage, budgets and limits")
    tsub.add_parser("list", help="list tenants")
    tr = tsub.add_parser("revoke", help="revoke a tenant and all its tokens")
    tr.add_argument("name")
    tb = tsub.add_parser("budget", help="set a tenant's budget in dollars per period (requests that could exceed "
                                        "it get 429 insufficient_quota)")
    tb.add_argument("name")
    tb.add_argument("amount", type=float, nargs="?", default=0.0)
    tb.add_argument("--period", choices=["day", "month", "none"], default="month")
    tb.add_argument("--model", default=None, help="only this model's requests (default: all models)")
    tb.add_argument("--clear", action="store_true", help="remove the budget")
    tm = tsub.add_parser("limits", help="set a tenant's rate limits (no flags: remove them)")
    tm.add_argument("name")
    tm.add_argument("--rpm", type=int, default=None, help="requests per minute")
    tm.add_argument("--tpm", type=int, default=None, help="tokens per minute (prompt + max_tokens, settled to real)")
    tl = tsub.add_parser("budgets", help="budgets with what is spent, held and left")
    tl.add_argument("name", nargs="?", default=None)
    for leaf in tsub.choices.values():
        add_store_arguments(leaf)
    t.set_defaults(func=cmd_tenants)

    u = sub.add_parser("usage", help="usage, charges and cost per time bucket (the store's ledger)")
    add_store_arguments(u)
    u.add_argument("--bucket", default="1d", help="1m, 1h or 1d (default)")
    u.add_argument("--buckets", type=int, default=7, help="how many buckets back from now (default 7)")
    u.add_argument("--group-by", default="tenant,model",
                   help="any of tenant,model,tier,adapter (default tenant,model)")
    u.add_argument("--tenant", default=None, help="one tenant only")
    u.add_argument("--csv", action="store_true", help="CSV instead of a table")
    u.set_defaults(func=cmd_usage)

    from kvserve.batch.cli import add_arguments as add_batch_arguments

    add_batch_arguments(sub.add_parser("batch", help="the batch API: submit a JSONL file, status, list, cancel, "
                                                      "download"))
    from kvserve.planning.cli import add_arguments as add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="capacity planning: the cheapest fleet for a load within SLOs; "
                                                    "calibrate, simulate, specs, context (one long sequence per KV dtype, policy and tier)"))
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvserve.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:  # a bad models TOML or engine argument: say which, no traceback
        print(f"kvserve: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvserve ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
