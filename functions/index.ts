/**
 * The Trellis Worker: composes the v1 API, and re-exports the task graph
 * Durable Object.
 */
import { Hono } from "hono";
import type { AppEnv } from "./app.ts";
import { authenticate } from "./auth.ts";
import { notFound, onError } from "./errors.ts";
import { hosts } from "./hosts.ts";
import { keys } from "./keys.ts";
import { rateLimit } from "./limits.ts";
import { projects } from "./projects.ts";
import { rollouts } from "./rollouts.ts";
import { sweep } from "./scheduled.ts";
import { snapshots } from "./snapshots.ts";
import { tasks } from "./tasks.ts";

export { TaskGraph } from "../durable-objects/task-graph.ts";

const app = new Hono<AppEnv>();

// Unauthenticated and does nothing: the runtime's floor, for benchmarks and probes.
app.get("/healthz", (c) => c.text("ok"));

// Authentication first: the rate limit counts per key.
app.use("/v1/*", authenticate, rateLimit);

// Any key: a round trip to a Durable Object that reads and writes nothing.
// Says the task graphs' namespace answers; the bench's floor for a call
// that needs its task graph. The object is named outside every project's
// `project/task` space, and is never indexed.
app.get("/v1/health", async (c) => {
	const probe = c.env.TASK_GRAPH.get(c.env.TASK_GRAPH.idFromName("health"));
	return c.json({ ok: await probe.ping() });
});
app.route("/v1/projects", projects);
app.route("/v1/keys", keys);
app.route("/v1/hosts", hosts);
app.route("/v1/tasks", tasks);
app.route("/v1/tasks", snapshots);
app.route("/v1/tasks", rollouts);

app.onError(onError);
app.notFound(notFound);

export default {
	fetch: app.fetch,
	scheduled: (controller, env, ctx) =>
		ctx.waitUntil(sweep(env, controller.scheduledTime)),
} satisfies ExportedHandler<Env>;
