"""The CLI's store commands (`kvserve tenants ...`, `kvserve usage`) open the store the server opens: the
--config TOML's [server] db_path (an SQLite file or a PostgreSQL URL), else $KVSERVE_DB, else the data
directory's kvserve.db (store_location, the one function both ask)."""
from __future__ import annotations

import time
from pathlib import Path

from kvserve.cli import main
from kvserve.config import ServerConfig
from kvserve.server.state import ServerState
from kvserve.store import Store, UsageRecord


def test_tenant_and_usage_commands_run_on_the_servers_store(store_target, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "elsewhere"))  # the default: it must not be used
    monkeypatch.delenv("KVSERVE_DB", raising=False)
    config = tmp_path / "server.toml"
    config.write_text(f'[server]\ndb_path = "{store_target}"\n')
    cfg = ["--config", str(config)]
    assert ServerState(ServerConfig.from_toml(str(config))).db_path in (store_target, Path(store_target))

    assert main(["tenants", "create", "acme", *cfg]) == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["tenants", "budget", "acme", "0.0000004", "--period", "day", *cfg]) == 0
    assert "left $0.0000004" in capsys.readouterr().out  # not "$0.000000"
    assert main(["tenants", "limits", "acme", "--rpm", "60", *cfg]) == 0
    assert main(["tenants", "budgets", *cfg]) == 0
    assert "$0.0000004" in capsys.readouterr().out
    with Store(store_target) as store:  # what the server reads
        assert store.authenticate(token).name == "acme"
        assert store.budgets.list("acme")[0].amount == 0.0000004
        store.record_usage_many([UsageRecord(request_id="r1", tenant="acme", model="m", tier="interactive",
                                             prompt_tokens=10, cached_prompt_tokens=0, completion_tokens=5,
                                             created_at=time.time(), price=0.00000123, cost=0.0000004,
                                             engine_s=0.01)])
    capsys.readouterr()
    assert main(["usage", *cfg]) == 0
    table = capsys.readouterr().out
    assert "acme" in table and "$0.00000123" in table
    assert main(["tenants", "revoke", "acme", *cfg]) == 0
    assert main(["tenants", "list", *cfg]) == 0
    assert "revoked" in capsys.readouterr().out
    assert not (tmp_path / "elsewhere").exists()

    monkeypatch.setenv("KVSERVE_DB", str(store_target))  # no TOML: the environment names the same store
    assert main(["tenants", "list"]) == 0
    assert "acme" in capsys.readouterr().out


def test_batch_commands_find_the_servers_address_and_dev_token(tmp_path, monkeypatch):
    """`kvserve batch --config server.toml ...` talks to that server with the dev token kept in its data dir."""
    import httpx

    monkeypatch.delenv("KVSERVE_URL", raising=False)
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "elsewhere"))
    home = tmp_path / "data"
    home.mkdir()
    (home / "dev-token").write_text("kvs-dev\n")
    config = tmp_path / "server.toml"
    config.write_text(f'[server]\nhome = "{home}"\nport = 8765\n')
    seen = {}

    class Client:
        def __init__(self, base_url, headers, timeout):
            seen.update(base_url=base_url, auth=headers["Authorization"])

        def request(self, method, path, **kw):
            return httpx.Response(200, json={"data": []}, request=httpx.Request(method, path))

    monkeypatch.setattr(httpx, "Client", Client)
    assert main(["batch", "--config", str(config), "list"]) == 0
    assert seen == {"base_url": "http://127.0.0.1:8765", "auth": "Bearer kvs-dev"}
