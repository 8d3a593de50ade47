import { cloudflareTest } from "@cloudflare/vitest-pool-workers";
import { defineConfig } from "vitest/config";

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
							bindings: { TRELLIS_ADMIN_KEY: "test-root-admin-key" },
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
