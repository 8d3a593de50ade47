CREATE TABLE `conflict_outputs` (
	`node_id` text NOT NULL,
	`digest` text NOT NULL,
	`seen_at` integer NOT NULL,
	PRIMARY KEY(`node_id`, `digest`)
);
