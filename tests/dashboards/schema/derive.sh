#!/bin/sh
# Regenerate dashboard.schema.json: the JSON schema of Grafana's dashboard model, derived from the
# `Dashboard` TypeScript type that Grafana publishes in the npm package @grafana/schema (the exact
# versions are pinned in package.json / package-lock.json). The result is committed, so `make test`
# validates dashboards without npm; run this only to move to a newer @grafana/schema.
#
# It lives under tests/, not dashboards/: Grafana's file provisioner imports every *.json below the
# folder it is pointed at, so dashboards/ holds nothing but dashboards.
#
# --expose none inlines every referenced type: the package defines two types named DataSourceRef
# (common and dashboard), which ts-json-schema-generator cannot both expose as named definitions.
set -eu
cd "$(dirname "$0")"
npm ci --no-audit --no-fund --loglevel=error
npx --no-install ts-json-schema-generator \
	--path node_modules/@grafana/schema/dist/types/index.d.ts \
	--type Dashboard \
	--expose none \
	--out dashboard.schema.json.tmp
# Say in the file where it came from, so nobody edits it by hand.
node -e '
const fs = require("fs");
const version = require("./node_modules/@grafana/schema/package.json").version;
const schema = JSON.parse(fs.readFileSync("dashboard.schema.json.tmp", "utf8"));
const out = { $comment: `Derived from @grafana/schema ${version} (type Dashboard) by tests/dashboards/schema/derive.sh; do not edit.`, ...schema };
fs.writeFileSync("dashboard.schema.json", JSON.stringify(out, null, 2) + "\n");
'
rm dashboard.schema.json.tmp
echo "tests/dashboards/schema/dashboard.schema.json derived from @grafana/schema $(node -p 'require("./node_modules/@grafana/schema/package.json").version')"
