import {
	cloudflareTest,
	readD1Migrations,
} from "@cloudflare/vitest-pool-workers";
import { defineConfig } from "vitest/config";

const d1Migrations = await readD1Migrations("./migrations/d1");

// Two projects: the Worker and its Durable Objects run inside workerd through
// the Workers pool; the clients, the local stack and the sandboxes run in Node
// against a real `wrangler dev`.
export default defineConfig({
	test: {
		projects: [
			{
				plugins: [
					cloudflareTest({
						wrangler: { configPath: "./wrangler.toml" },
						miniflare: {
							bindings: {
								TRELLIS_ADMIN_KEY: "test-root-admin-key",
								TEST_D1_MIGRATIONS: d1Migrations,
								// Small, so tests can push outputs into R2 cheaply.
								OUTPUT_INLINE_MAX_BYTES: "1024",
								OUTPUT_MAX_BYTES: "262144",
								// Small, so a test can see the eviction log let old rows go.
								EVICTION_LOG_ROWS: "6",
							},
							// A second limiter with a tiny limit, which the rate limit
							// tests put in RATE_LIMITER's place: the real one stays
							// generous, so that no other test file is ever limited.
							ratelimits: {
								TEST_RATE_LIMITER: { simple: { limit: 3, period: 60 } },
							},
						},
					}),
				],
				test: {
					name: "worker",
					include: ["test/worker/**/*.test.ts"],
					setupFiles: ["./test/worker/setup.ts"],
				},
			},
			{
				test: {
					name: "node",
					include: ["test/node/**/*.test.ts"],
					environment: "node",
					testTimeout: 60_000,
					hookTimeout: 120_000,
					// The node tests share one local stack per file; files run in parallel.
					fileParallelism: true,
				},
			},
		],
	},
});
