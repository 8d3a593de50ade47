/**
 * Bearer API keys. A key is 32 random bytes written as `trk_` + hex; D1
 * stores only its SHA-256 (keys are high-entropy, so a fast hash is enough).
 * The root admin key is the Worker secret TRELLIS_ADMIN_KEY: it creates
 * projects and keys, and sees no task.
 *
 * Revocation: verified keys are remembered per isolate for KEY_CACHE_MS so
 * that a hit answered from the Worker's memory does not wait on D1 (a D1 read
 * from a far location costs tens of milliseconds; a hit costs a few). The
 * isolate that revokes or rotates a key forgets it at once, so a revoked key
 * is refused from then on by that isolate; other isolates may accept it for
 * at most KEY_CACHE_MS more. That bound is a deliberate trade: making
 * revocation exact everywhere needs a shared read on every request, which is
 * the cost the edge cache exists to avoid. A rotated key's grace end
 * (`expires_at`) is exact in an isolate that first reads the key after the
 * rotation: the end is known when it caches the key, and the entry never
 * outlives it. An isolate that cached the key before the rotation does not
 * know the end, and may accept the key for up to KEY_CACHE_MS past it, as
 * for a revocation.
 *
 * Tokens are checked for their form before anything is remembered: only
 * the root key and well-formed API keys (`trk_` + 64 hex digits) are kept
 * in this isolate's memory or looked up in D1. Anything else, or anything
 * longer than MAX_TOKEN_CHARS, is a 401 at once; a request without a valid
 * key is not rate limited (functions/limits.ts), so it must cost little.
 */
import { createHash, timingSafeEqual } from "node:crypto";
import type { Context } from "hono";
import { createMiddleware } from "hono/factory";
import { TaskName, type Role } from "../core/api.ts";
import { now } from "../core/clock.ts";
import type { AppEnv, GraphStub, Principal } from "./app.ts";
import { apiError } from "./errors.ts";

/** How long an isolate trusts what D1 said about a key (see above). */
export const KEY_CACHE_MS = 5000;
const keyCache = new Map<
	string,
	{ principal: Principal | null; until: number }
>();

/** SHA-256 of a key, hex: what D1 stores and looks keys up by. */
export function hashKey(key: string): string {
	return createHash("sha256").update(key, "utf8").digest("hex");
}

/** A new secret key: `trk_` and 32 random bytes in hex. */
export function newKey(): string {
	const bytes = new Uint8Array(32);
	crypto.getRandomValues(bytes);
	return `trk_${Buffer.from(bytes).toString("hex")}`;
}

/** Drops this isolate's memory of a key, so its next use asks D1. */
export function forgetKey(hash: string): void {
	keyCache.delete(hash);
}

/** What {@link newKey} makes: the only API keys D1 can hold. */
const KEY_FORM = /^trk_[0-9a-f]{64}$/;
/**
 * Longer tokens are refused unread (unless the root secret is longer). Far
 * above a key's 68 characters and any sensible root secret.
 */
export const MAX_TOKEN_CHARS = 512;

/**
 * The hash of each well-formed token this isolate has seen, and whether it
 * is the root key: a known key costs a map lookup instead of a hash on every
 * request. Filled under one root secret; a different secret starts it
 * afresh. Holds at most 10,000 tokens of at most MAX_TOKEN_CHARS.
 */
const seen = new Map<string, { hash: string; root: boolean }>();
let seenUnder: string | undefined;
let rootHash: Buffer | null = null;

/** How many tokens this isolate remembers (for tests). */
export function rememberedTokens(): number {
	return seen.size;
}

/** A token's hash and whether it is the root key; null if it cannot be a key. */
function identify(
	key: string,
	secret: string | undefined,
): { hash: string; root: boolean } | null {
	if (secret !== seenUnder) {
		seen.clear();
		seenUnder = secret;
		rootHash =
			secret === undefined || secret === ""
				? null
				: Buffer.from(hashKey(secret), "hex");
	}
	const known = seen.get(key);
	if (known) return known;
	if (key.length > Math.max(MAX_TOKEN_CHARS, secret?.length ?? 0)) return null;
	const hash = hashKey(key);
	const root =
		rootHash !== null && timingSafeEqual(Buffer.from(hash, "hex"), rootHash);
	if (!root && !KEY_FORM.test(key)) return null;
	if (seen.size >= 10_000) seen.clear();
	seen.set(key, { hash, root });
	return { hash, root };
}

async function resolve(env: Env, key: string): Promise<Principal | null> {
	const id = identify(key, env.TRELLIS_ADMIN_KEY);
	if (id === null) return null;
	const { hash, root } = id;
	if (root) return { kind: "root" };
	const t = now();
	const cached = keyCache.get(hash);
	if (cached && cached.until > t) return cached.principal;
	const row = await env.DB.prepare(
		`select id, project_id, role, expires_at from api_keys
		 where hash = ?1 and revoked_at is null
		   and (expires_at is null or expires_at > ?2)`,
	)
		.bind(hash, t)
		.first<{
			id: string;
			project_id: string;
			role: Role;
			expires_at: number | null;
		}>();
	const principal: Principal | null = row
		? { kind: "key", keyId: row.id, project: row.project_id, role: row.role }
		: null;
	if (keyCache.size > 10_000) keyCache.clear();
	keyCache.set(hash, {
		principal,
		until: Math.min(t + KEY_CACHE_MS, row?.expires_at ?? Infinity),
	});
	return principal;
}

/** Authenticates every request under it; 401 without a valid key. */
export const authenticate = createMiddleware<AppEnv>(async (c, next) => {
	const header = c.req.header("authorization") ?? "";
	const m = /^Bearer\s+(\S+)\s*$/i.exec(header);
	if (!m) {
		throw apiError(401, "unauthorized", "send `Authorization: Bearer <key>`", {
			"WWW-Authenticate": 'Bearer realm="trellis"',
		});
	}
	const principal = await resolve(c.env, m[1]);
	if (!principal) {
		throw apiError(401, "unauthorized", "unknown, revoked or malformed key", {
			"WWW-Authenticate": 'Bearer realm="trellis", error="invalid_token"',
		});
	}
	c.set("principal", principal);
	await next();
});

/** Lets through the roles named; the root key only where `root` is set. */
export function allow(roles: Role[], opts: { root?: boolean } = {}) {
	return createMiddleware<AppEnv>(async (c, next) => {
		const p = c.get("principal");
		const allowed =
			p.kind === "root" ? opts.root === true : roles.includes(p.role);
		if (!allowed) {
			const who = p.kind === "root" ? "the root admin key" : `a ${p.role} key`;
			throw apiError(
				403,
				"forbidden",
				`${who} may not ${c.req.method} ${c.req.path}`,
			);
		}
		await next();
	});
}

/** Puts the caller's scope on `c.var`; `graph(c)` names its Durable Object. */
export const taskScope = createMiddleware<AppEnv>(async (c, next) => {
	const p = c.get("principal");
	if (p.kind !== "key") {
		throw apiError(
			403,
			"forbidden",
			"the root admin key sees no task; use a project key",
		);
	}
	const name = TaskName.safeParse(c.req.param("task"));
	if (!name.success) {
		throw apiError(
			400,
			"invalid_request",
			`task: ${name.error.issues[0].message}`,
		);
	}
	c.set("scope", { project: p.project, task: name.data });
	await next();
});

/**
 * The task's Durable Object stub, named on first use: a hit answered from
 * the Worker's memory never names it.
 */
export function graph(c: Context<AppEnv>): GraphStub {
	let stub = c.get("graph");
	if (stub === undefined) {
		const { project, task } = c.get("scope");
		stub = c.env.TASK_GRAPH.get(
			c.env.TASK_GRAPH.idFromName(`${project}/${task}`),
		);
		c.set("graph", stub);
	}
	return stub;
}
