-- scripts/bench --citus: the queue's table and the application's role, on the single
-- node and on the cluster's coordinator (psql -v citus=on|off). On the cluster the
-- table is distributed by tenant and pg_quota's start() and finish_for() by their
-- tenant argument (USER_GUIDE "Citus").
CREATE TABLE jobs (tenant text NOT NULL, id bigserial, payload text, ticket uuid,
                   done_at timestamptz, PRIMARY KEY (tenant, id));
CREATE FUNCTION finish_for(tenant text, ticket uuid, outcome text DEFAULT 'succeeded')
  RETURNS bool LANGUAGE plpgsql STRICT AS 'BEGIN RETURN quota.finish(ticket, outcome); END';
\if :citus
SELECT create_distributed_table('jobs', 'tenant');
SELECT create_distributed_function('quota.start(text,interval,text,interval,text,boolean)',
                                   '$5', colocate_with := 'jobs', force_delegation := true);
SELECT create_distributed_function('finish_for(text,uuid,text)', '$1',
                                   colocate_with := 'jobs', force_delegation := true);
\endif
GRANT ALL ON SCHEMA public TO app;
GRANT ALL ON jobs, jobs_id_seq TO app;
ALTER ROLE app SET quota.max_active_per_tenant = 1000;
ALTER ROLE app SET quota.max_retained_per_role = 0;
ALTER ROLE app SET quota.allow_transactional = on;
-- The recipe of whole calls (USER_GUIDE "Citus"): one call enqueues, one completes,
-- each distributed by tenant, so Citus runs each whole on the tenant's node, where
-- the start or finish and the row's change are one local transaction. `admit`
-- switches pg_quota off for JOB's run of the same calls (citus_fjob.sql). The start
-- is the weighted overload, which is not distributed: Citus plans a call of a
-- distributed function anew each time its arguments are parameters (USER_GUIDE).
CREATE FUNCTION enqueue(tenant text, payload text, admit bool) RETURNS bigint
  LANGUAGE plpgsql STRICT AS $$
DECLARE tk uuid; job bigint;
BEGIN
  IF admit THEN
    tk := quota.start(weight => 1, tenant => tenant, label => 'job', transactional => true);
  END IF;
  INSERT INTO jobs (tenant, payload, ticket) VALUES (tenant, payload, tk) RETURNING id INTO job;
  RETURN job;
END $$;
CREATE FUNCTION complete(tenant text, job bigint) RETURNS bool LANGUAGE plpgsql STRICT AS $$
DECLARE tk uuid;
BEGIN
  UPDATE jobs j SET done_at = now()
   WHERE j.tenant = complete.tenant AND j.id = job AND j.done_at IS NULL
  RETURNING j.ticket INTO tk;
  IF NOT FOUND THEN RAISE EXCEPTION 'no job % of tenant % to complete', job, tenant; END IF;
  RETURN tk IS NULL OR quota.finish(tk);  -- JOB's jobs have no ticket
END $$;
\if :citus
SELECT create_distributed_function('enqueue(text,text,bool)', '$1',
                                   colocate_with := 'jobs', force_delegation := true);
SELECT create_distributed_function('complete(text,bigint)', '$1',
                                   colocate_with := 'jobs', force_delegation := true);
\endif
-- The recipe in statements with the finish in the queue's own completion: the
-- completion UPDATE of tjobs fires quota.finish_job() on the row's shard, on the
-- tenant's node (USER_GUIDE "Citus", the queue's own triggers). JOB runs the same
-- statements on tjobs without a ticket, so the trigger's WHEN is all it costs there.
CREATE TABLE tjobs (tenant text NOT NULL, id bigserial, payload text, ticket uuid,
                    done_at timestamptz, PRIMARY KEY (tenant, id));
\if :citus
SELECT create_distributed_table('tjobs', 'tenant', colocate_with := 'jobs');
SET citus.enable_unsafe_triggers = on;
\endif
CREATE TRIGGER quota_job_done AFTER UPDATE OF done_at ON tjobs FOR EACH ROW
  WHEN (NEW.done_at IS NOT NULL AND OLD.done_at IS NULL AND NEW.ticket IS NOT NULL)
  EXECUTE FUNCTION quota.finish_job('ticket', 'succeeded');
GRANT ALL ON tjobs, tjobs_id_seq TO app;
