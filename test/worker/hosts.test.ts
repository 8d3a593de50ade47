import { beforeAll, describe, expect, it } from "vitest";
import { advanceClock } from "../../core/clock.ts";
import { api, expectError, project } from "./helpers.ts";

let keys: Awaited<ReturnType<typeof project>>;
let other: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	keys = await project("hosts");
	other = await project("hosts-other");
});

const registration = {
	url: "http://127.0.0.1:9",
	capacity: 4,
	drivers: ["workspace"],
};

describe("container hosts", () => {
	it("registers a host with a host key, issuing it a signing secret", async () => {
		const r = await api("POST", "/v1/hosts", {
			key: keys.host,
			json: registration,
		});
		expect(r.status).toBe(201);
		expect(r.body.id).toMatch(/^[0-9a-f-]{36}$/);
		expect(r.body.secret).toMatch(/^[0-9a-f]{64}$/);
		expect(r.body.heartbeatMs).toBeGreaterThan(0);
		const list = await api("GET", "/v1/hosts", { key: keys.trainer });
		const h = list.body.hosts.find((x: { id: string }) => x.id === r.body.id);
		expect(h).toMatchObject({
			url: registration.url,
			capacity: 4,
			drivers: ["workspace"],
			status: "up",
		});
		expect(JSON.stringify(list.body)).not.toContain(r.body.secret);
	});

	it("counts a host down after missed heartbeats, and up again after one", async () => {
		const r = await api("POST", "/v1/hosts", {
			key: keys.host,
			json: registration,
		});
		advanceClock(60_000);
		const status = async () =>
			(await api("GET", "/v1/hosts", { key: keys.host })).body.hosts.find(
				(x: { id: string }) => x.id === r.body.id,
			).status;
		expect(await status()).toBe("down");
		const beat = await api("POST", `/v1/hosts/${r.body.id}/heartbeat`, {
			key: keys.host,
			json: { sandboxes: 2, busy: 1 },
		});
		expect(beat.body).toEqual({ ok: true });
		expect(await status()).toBe("up");
	});

	it("keeps hosts per project: another project's key neither sees nor beats them", async () => {
		const r = await api("POST", "/v1/hosts", {
			key: keys.host,
			json: registration,
		});
		const list = await api("GET", "/v1/hosts", { key: other.trainer });
		expect(list.body.hosts).toEqual([]);
		const beat = await api("POST", `/v1/hosts/${r.body.id}/heartbeat`, {
			key: other.host,
			json: { sandboxes: 0, busy: 0 },
		});
		expectError(beat, 404, "host_not_found");
	});

	it("deregisters a host, which then neither lists nor beats; another project cannot", async () => {
		const r = await api("POST", "/v1/hosts", {
			key: keys.host,
			json: registration,
		});
		expectError(
			await api("DELETE", `/v1/hosts/${r.body.id}`, { key: other.host }),
			404,
			"host_not_found",
		);
		const gone = await api("DELETE", `/v1/hosts/${r.body.id}`, {
			key: keys.host,
		});
		expect(gone.body).toEqual({ id: r.body.id, deregistered: true });
		const list = await api("GET", "/v1/hosts", { key: keys.host });
		expect(list.body.hosts.map((h: { id: string }) => h.id)).not.toContain(
			r.body.id,
		);
		expectError(
			await api("POST", `/v1/hosts/${r.body.id}/heartbeat`, {
				key: keys.host,
				json: { sandboxes: 0, busy: 0 },
			}),
			404,
			"host_not_found",
		);
	});

	it("refuses bad registrations and keys without the host role", async () => {
		expectError(
			await api("POST", "/v1/hosts", { key: keys.trainer, json: registration }),
			403,
			"forbidden",
		);
		for (const json of [
			{ ...registration, url: "not a url" },
			{ ...registration, capacity: 0 },
			{ ...registration, drivers: ["vm"] },
			{ ...registration, drivers: [] },
			{ ...registration, extra: true },
		]) {
			expectError(
				await api("POST", "/v1/hosts", { key: keys.host, json }),
				400,
				"invalid_request",
			);
		}
		expectError(
			await api("POST", "/v1/hosts/x/heartbeat", {
				key: keys.host,
				json: { sandboxes: -1, busy: 0 },
			}),
			400,
			"invalid_request",
		);
	});
});

describe("managed rollouts without a host", () => {
	it("opens a rollout, and a miss with no host to run it is 503 with Retry-After", async () => {
		const fresh = await project("no-hosts");
		const open = await api("POST", "/v1/tasks/t/rollouts", {
			key: fresh.trainer,
			json: { template: { driver: "docker" } },
		});
		expect(open.status).toBe(201);
		expect(open.body).toMatchObject({
			calls: 0,
			hits: 0,
			misses: 0,
			closed: false,
		});
		const call = await api(
			"POST",
			`/v1/tasks/t/rollouts/${open.body.id}/calls`,
			{
				key: fresh.trainer,
				json: { tool: "bash", args: { cmd: "ls" } },
			},
		);
		expectError(call, 503, "no_host");
		expect(call.headers.get("retry-after")).toBe("5");
		// Nothing was recorded for it.
		const stats = await api("GET", "/v1/tasks/t/stats", { key: fresh.trainer });
		expect(stats.body).toMatchObject({ nodes: 1, misses: 1 });
	});

	it("answers 404 for an unknown rollout, 409 for a closed one, 400 for a bad template", async () => {
		const keys = await project("no-hosts-2");
		expectError(
			await api("POST", "/v1/tasks/t/rollouts/nope/calls", {
				key: keys.trainer,
				json: { tool: "x" },
			}),
			404,
			"rollout_not_found",
		);
		const open = await api("POST", "/v1/tasks/t/rollouts", {
			key: keys.trainer,
			json: { template: { driver: "workspace" } },
		});
		const closed = await api("DELETE", `/v1/tasks/t/rollouts/${open.body.id}`, {
			key: keys.trainer,
		});
		expect(closed.body).toMatchObject({ id: open.body.id, closed: true });
		expectError(
			await api("POST", `/v1/tasks/t/rollouts/${open.body.id}/calls`, {
				key: keys.trainer,
				json: { tool: "x" },
			}),
			409,
			"rollout_closed",
		);
		expectError(
			await api("POST", "/v1/tasks/t/rollouts", {
				key: keys.trainer,
				json: { template: { driver: "vm" } },
			}),
			400,
			"invalid_request",
		);
	});
});
