/**
 * Runs a container host until Ctrl-C.
 *
 *   tsx bin/host.ts --worker URL --key KEY [--port N] [--capacity N]
 *       [--drivers workspace,docker,sqlite] [--name NAME]
 *       [--hostname ADDR] [--public-url URL] [--data-dir DIR] [--idle-ms N]
 *       [--seed NAME=DIR]... [--image NAME=IMAGE]... [--database NAME=FILE]...
  [--isolate auto|bwrap|none] [--bind PATH]...
 *       [--isolate auto|bwrap|none] [--bind PATH]...
 *       [--warm DRIVER[:NAME]=COUNT]...
 *
 * `--worker` and `--key` default to TRELLIS_URL and TRELLIS_HOST_KEY (what
 * `trellis dev` prints). It prints the host's URL and id once registered.
 */
import path from "node:path";
import { parseArgs } from "node:util";
import { Driver, type Template } from "../core/host-api.ts";
import { createHost } from "../host/server.ts";

const USAGE = `usage: tsx bin/host.ts --worker URL --key KEY [--port N] [--capacity N]
  [--drivers workspace,docker,sqlite] [--name NAME] [--hostname ADDR]
  [--public-url URL] [--data-dir DIR] [--idle-ms N]
  [--seed NAME=DIR]... [--image NAME=IMAGE]... [--database NAME=FILE]...
  [--warm DRIVER[:NAME]=COUNT]...`;

function fail(message: string): never {
	console.error(`${message}\n${USAGE}`);
	process.exit(2);
}

function int(name: string, value: string | undefined): number | undefined {
	if (value === undefined) return undefined;
	const n = Number(value);
	if (!Number.isSafeInteger(n) || n < 0) fail(`--${name}: not a number`);
	return n;
}

/** `NAME=VALUE` pairs of a repeated option. */
function pairs(name: string, values: string[] | undefined) {
	const out: Record<string, string> = {};
	for (const v of values ?? []) {
		const at = v.indexOf("=");
		if (at <= 0) fail(`--${name}: give NAME=VALUE, got ${v}`);
		out[v.slice(0, at)] = v.slice(at + 1);
	}
	return out;
}

function isolateMode(
	v: string | undefined,
): "auto" | "bwrap" | "none" | undefined {
	if (v === undefined || v === "auto" || v === "bwrap" || v === "none")
		return v;
	fail(`--isolate: auto, bwrap or none, not ${v}`);
}

async function main(): Promise<void> {
	const { values } = parseArgs({
		options: {
			worker: { type: "string", default: process.env.TRELLIS_URL },
			key: { type: "string", default: process.env.TRELLIS_HOST_KEY },
			port: { type: "string" },
			capacity: { type: "string" },
			drivers: { type: "string" },
			name: { type: "string" },
			hostname: { type: "string" },
			"public-url": { type: "string" },
			"data-dir": { type: "string" },
			"idle-ms": { type: "string" },
			seed: { type: "string", multiple: true },
			image: { type: "string", multiple: true },
			database: { type: "string", multiple: true },
			warm: { type: "string", multiple: true },
			isolate: { type: "string" },
			bind: { type: "string", multiple: true },
			help: { type: "boolean", short: "h" },
		},
	});
	if (values.help) {
		console.log(USAGE);
		return;
	}
	if (!values.worker) fail("give --worker (or TRELLIS_URL)");
	if (!values.key) fail("give --key (or TRELLIS_HOST_KEY)");
	const drivers = values.drivers?.split(",").map((d) => {
		const r = Driver.safeParse(d.trim());
		if (!r.success) fail(`--drivers: unknown driver ${d}`);
		return r.data;
	});
	const seeds = pairs("seed", values.seed);
	for (const [k, dir] of Object.entries(seeds)) seeds[k] = path.resolve(dir);
	const databases = pairs("database", values.database);
	for (const [k, f] of Object.entries(databases))
		databases[k] = path.resolve(f);
	const pools = Object.entries(pairs("warm", values.warm)).map(
		([spec, count]) => {
			const [driver, name] = spec.split(":", 2);
			const d = Driver.safeParse(driver);
			if (!d.success) fail(`--warm: unknown driver ${driver}`);
			const template: Template = { driver: d.data };
			if (name) template.name = name;
			return { template, count: int("warm", count) ?? 0 };
		},
	);

	const host = createHost({
		worker: values.worker,
		key: values.key,
		port: int("port", values.port),
		capacity: int("capacity", values.capacity),
		drivers,
		name: values.name,
		hostname: values.hostname,
		publicUrl: values["public-url"],
		dataDir: values["data-dir"],
		idleMs: int("idle-ms", values["idle-ms"]),
		templates: {
			workspace: {
				seeds,
				isolate: isolateMode(values.isolate),
				binds: values.bind?.map((b) => path.resolve(b)),
			},
			docker: { images: pairs("image", values.image) },
			sqlite: { databases },
		},
		pools,
	});
	// Listen before starting: Ctrl-C while registering must still clean up.
	const interrupted = new Promise<void>((resolve) => {
		process.once("SIGINT", resolve);
		process.once("SIGTERM", resolve);
	});
	const { url, id } = await host.start();
	console.log(`host ${id} at ${url} (drivers: ${host.drivers.join(", ")})`);
	await interrupted;
	console.log("stopping the host...");
	await host.stop();
}

main().catch((err) => {
	console.error(err instanceof Error ? err.message : err);
	process.exit(1);
});
