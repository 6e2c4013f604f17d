#!/usr/bin/env python3
"""Check Grafana dashboards: the JSON schema derived from Grafana's @grafana/schema
(tests/dashboards/schema/, see derive.sh there), then the house rules the schema cannot express.

    python3 tests/dashboards/check.py dashboards/*.json

House rules, because users import these dashboards into Grafanas we never see:
- the Prometheus datasource is the `datasource` variable, and every panel and query uses it;
- the `device`, `pool` and `service` variables exist (query variables over the same datasource);
- every panel has a description, a unit, thresholds, and queries with a PromQL expression;
- schemaVersion is that of Grafana 10 or newer, and panel ids are unique.

Prints every problem as `file: where: what` and exits 1 when there is any.
"""

import json
import sys
from pathlib import Path

import jsonschema

SCHEMA = Path(__file__).parent / "schema" / "dashboard.schema.json"
DATASOURCE = "${datasource}"
MIN_SCHEMA_VERSION = 38  # Grafana 10.0
QUERY_VARIABLES = ("device", "pool", "service")


def closest_errors(error):
    """For an `anyOf` failure (a panel is a Panel or a RowPanel; a datasource an object or null),
    the errors of the alternative that came closest, instead of the whole value dumped as text."""
    if not error.context:
        return [error]
    branches = {}
    for sub in error.context:
        branches.setdefault(sub.schema_path[0], []).append(sub)
    return [leaf for sub in min(branches.values(), key=len) for leaf in closest_errors(sub)]


def schema_problems(dashboard, validator):
    for error in sorted(validator.iter_errors(dashboard), key=lambda e: list(e.absolute_path)):
        for leaf in closest_errors(error):
            where = "/".join(str(p) for p in leaf.absolute_path) or "(top)"
            yield where, f"schema: {leaf.message}"


def uses_datasource_variable(ref):
    return isinstance(ref, dict) and ref.get("uid") == DATASOURCE


def panels_of(dashboard):
    """Every panel with its JSON path, rows' nested panels included; rows themselves are not panels."""
    for i, panel in enumerate(dashboard.get("panels", [])):
        if panel.get("type") == "row":
            for j, inner in enumerate(panel.get("panels", [])):
                yield f"panels/{i}/panels/{j}", inner
        else:
            yield f"panels/{i}", panel


def panel_problems(where, panel):
    title = panel.get("title") or "(untitled)"
    at = f"{where} ({title})"
    if not str(panel.get("description", "")).strip():
        yield at, "no description"
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    if not str(defaults.get("unit", "")).strip():
        yield at, "no unit in fieldConfig.defaults"
    if not defaults.get("thresholds", {}).get("steps"):
        yield at, "no thresholds in fieldConfig.defaults"
    if not uses_datasource_variable(panel.get("datasource")):
        yield at, f"datasource is not {DATASOURCE}: {panel.get('datasource')!r}"
    targets = panel.get("targets") or []
    if not targets:
        yield at, "no targets"
    for k, target in enumerate(targets):
        if not str(target.get("expr", "")).strip():
            yield f"{at} targets/{k}", "no expr"
        if "datasource" in target and not uses_datasource_variable(target["datasource"]):
            yield f"{at} targets/{k}", f"datasource is not {DATASOURCE}: {target['datasource']!r}"


def variable_problems(dashboard):
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    datasource = variables.get("datasource")
    if not datasource:
        yield "templating", "no `datasource` variable"
    elif datasource.get("type") != "datasource" or datasource.get("query") != "prometheus":
        yield "templating/datasource", "must be a datasource variable with query `prometheus`"
    for name in QUERY_VARIABLES:
        variable = variables.get(name)
        if not variable:
            yield "templating", f"no `{name}` variable"
            continue
        if variable.get("type") != "query":
            yield f"templating/{name}", "must be a query variable"
        if not uses_datasource_variable(variable.get("datasource")):
            yield f"templating/{name}", f"datasource is not {DATASOURCE}"
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        if not text.strip():
            yield f"templating/{name}", "no query"


def problems(dashboard, validator):
    yield from schema_problems(dashboard, validator)
    if dashboard.get("schemaVersion", 0) < MIN_SCHEMA_VERSION:
        yield "schemaVersion", f"{dashboard.get('schemaVersion')} is older than Grafana 10 ({MIN_SCHEMA_VERSION})"
    yield from variable_problems(dashboard)
    seen = {}
    for where, panel in panels_of(dashboard):
        yield from panel_problems(where, panel)
        if panel.get("id") in seen:
            yield where, f"id {panel.get('id')} already used by {seen[panel.get('id')]}"
        seen[panel.get("id")] = where


def main(paths):
    if not paths:
        print("usage: check.py DASHBOARD.json...", file=sys.stderr)
        return 2
    schema = json.loads(SCHEMA.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    failed = False
    for path in paths:
        try:
            dashboard = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"{path}: {e}")
            failed = True
            continue
        found = list(problems(dashboard, validator))
        for where, what in found:
            print(f"{path}: {where}: {what}")
        if found:
            failed = True
        else:
            panels = sum(1 for _ in panels_of(dashboard))
            print(f"{path}: ok ({panels} panels, schema {SCHEMA.name}, house rules)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
