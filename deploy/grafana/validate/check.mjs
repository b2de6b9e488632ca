// Type-checks ../zeroplane.json against Grafana's published schema (@grafana/schema).
//
//   npm ci && node check.mjs [dashboard.json]
//
// The JSON is written into a TypeScript file as object literals annotated with the
// schema's types, so tsc checks required fields, enum values and (through excess
// property checks) unknown keys: the dashboard as `Dashboard`, each panel's options and
// custom field config as its panel type's `Options` / `FieldConfig`, each variable as
// `VariableModel`, and each Prometheus query as `DataQuery` plus the Prometheus fields
// below (Grafana's Prometheus query type is not in @grafana/schema).
import { execFileSync } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const file = resolve(process.argv[2] ?? join(here, "..", "zeroplane.json"));
const dashboard = JSON.parse(readFileSync(file, "utf8"));

const PANEL_TYPES = {
  timeseries: "TimeSeries", stat: "Stat", bargauge: "BarGauge", table: "Table",
  gauge: "Gauge", text: "Text", heatmap: "Heatmap", piechart: "PieChart",
};
const lit = (value) => JSON.stringify(value, null, 2);

const lines = [
  `import type {
  AnnotationQuery, Dashboard, DataQuery, Panel, RowPanel, VariableModel,
} from "@grafana/schema";`,
];
for (const name of new Set(Object.values(PANEL_TYPES))) {
  lines.push(`import type * as ${name} from ` +
    `"@grafana/schema/dist/esm/raw/composable/${name.toLowerCase()}/panelcfg/x/${name}PanelCfg_types.gen";`);
}
lines.push(`
// Grafana's types use TypeScript enums, which a JSON string never is; Json<T> is T with
// every string enum replaced by the union of its values (numeric enums accept numbers).
type Json<T> = T extends string
  ? \`\${T}\`
  : T extends readonly (infer U)[]
    ? Json<U>[]
    : T extends object
      ? { [K in keyof T]: Json<T[K]> }
      : T;

interface PrometheusQuery extends DataQuery {
  expr: string;
  legendFormat?: string;
  instant?: boolean;
  range?: boolean;
  format?: "time_series" | "table" | "heatmap";
  interval?: string;
  exemplar?: boolean;
  editorMode?: "code" | "builder";
}
`);
// Annotation targets are Prometheus queries: checked one by one below, and left out of the
// Dashboard check, whose annotation type only knows the generic DataQuery fields.
const annotations = dashboard.annotations?.list ?? [];
const withoutTargets = {
  ...dashboard,
  annotations: { ...dashboard.annotations, list: annotations.map(({ target, ...a }) => a) },
};
lines.push(`export const dashboard: Json<Dashboard> = ${lit(withoutTargets)};`);
annotations.forEach((a, i) => {
  lines.push(`export const annotation${i}: Json<AnnotationQuery<PrometheusQuery>> = ${lit(a)};`);
});

const panels = [];
for (const p of dashboard.panels ?? []) {
  panels.push(p);
  if (p.type === "row") panels.push(...(p.panels ?? []));
}
const problems = [];
for (const p of panels) {
  const id = `p${p.id}`;
  if (p.type === "row") {
    lines.push(`export const ${id}: Json<RowPanel> = ${lit(p)};`);
    continue;
  }
  const kind = PANEL_TYPES[p.type];
  if (!kind) {
    problems.push(`panel ${p.id} (${p.title}): type ${p.type} has no schema here`);
    continue;
  }
  lines.push(`export const ${id}: Json<Panel<${kind}.Options>> = ${lit(p)};`);
  lines.push(`export const ${id}_options: Json<${kind}.Options> = ${lit(p.options ?? {})};`);
  const custom = p.fieldConfig?.defaults?.custom;
  if (custom !== undefined) {
    const type = p.type === "table" ? "Table.FieldConfig" : `${kind}.FieldConfig`;
    lines.push(`export const ${id}_custom: Json<${type}> = ${lit(custom)};`);
  }
  (p.targets ?? []).forEach((t, i) => {
    lines.push(`export const ${id}_t${i}: Json<PrometheusQuery> = ${lit(t)};`);
  });
}
(dashboard.templating?.list ?? []).forEach((v, i) => {
  lines.push(`export const var${i}: Json<VariableModel> = ${lit(v)};`);
});
if (problems.length) {
  console.error(problems.join("\n"));
  process.exit(1);
}

const out = join(here, "generated");
mkdirSync(out, { recursive: true });
writeFileSync(join(out, "check.ts"), lines.join("\n") + "\n");
try {
  execFileSync(join(here, "node_modules", ".bin", "tsc"), ["-p", join(here, "tsconfig.json")], {
    stdio: "inherit",
  });
} catch {
  console.error(`${file} does not match @grafana/schema (tsc errors above)`);
  process.exit(1);
}
console.log(`${file}: ${panels.length} panels match @grafana/schema`);
