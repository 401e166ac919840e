// Validates every object of a rendered manifest (multi-document YAML on stdin) against
// the Kubernetes and Prometheus Operator schemas of the `kubernetes-models` packages.
// Prints one line per object; exits 1 if any is invalid or of an unknown kind.
import { parseAllDocuments } from "yaml";

const text = await new Promise((resolve) => {
  let s = "";
  process.stdin.on("data", (d) => (s += d));
  process.stdin.on("end", () => resolve(s));
});
let failed = 0;
for (const doc of parseAllDocuments(text)) {
  const o = doc.toJS();
  if (!o) continue;
  const name = `${o.kind}/${o.metadata?.name}`;
  const module = o.apiVersion.startsWith("monitoring.coreos.com/")
    ? `@kubernetes-models/prometheus-operator/${o.apiVersion}`
    : `kubernetes-models/${o.apiVersion}`;
  try {
    const models = await import(module);
    const Model = models[o.kind];
    if (!Model) throw new Error(`no schema for ${o.kind} in ${module}`);
    new Model(o).validate();
    console.log(`valid ${o.apiVersion} ${name}`);
  } catch (e) {
    failed += 1;
    console.log(`INVALID ${o.apiVersion} ${name}: ${e.message}`);
  }
}
process.exit(failed ? 1 : 0);
