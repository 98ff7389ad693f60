//! 0.6.0: `quota.finish_job()`, the trigger that finishes a job's ticket in the
//! transaction in which the queue ends the job (its status update, or the delete of its
//! row), and `quota.claim_job()`, the trigger that renews it in the transaction in which
//! the queue claims the job. What the triggers' arguments mean, and how a ticket is read
//! from text, are decided here; job_trigger.rs reads (and for a claim, writes) the row.
//!
//! ```sql
//! CREATE TRIGGER name AFTER UPDATE OR DELETE ON jobs FOR EACH ROW [WHEN (condition)]
//!   EXECUTE FUNCTION quota.finish_job('args->ticket' [, 'succeeded'])
//! CREATE TRIGGER name BEFORE UPDATE ON jobs FOR EACH ROW [WHEN (condition)]
//!   EXECUTE FUNCTION quota.claim_job('args->ticket', '5 minutes')
//! ```
//!
//! The first argument names where the ticket is: a column (uuid or text), or a json or
//! jsonb column and the keys to follow, `column->key->key`, written without spaces and
//! matched exactly (no case folding, no quotes). For finish_job() the second is the
//! outcome, a literal (`succeeded` by default): one trigger per outcome, each with its
//! own WHEN. For claim_job() it is the lease the ticket gets from the claim, an interval
//! (required; PostgreSQL's interval input reads it).

#![allow(clippy::result_large_err)]

use super::errors::{JobFn, QuotaError};
use super::ticket::{parse_outcome, Outcome};

/// What a job trigger does to the ticket it reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobAction {
    /// quota.finish_job(): finish it with this outcome.
    Finish(Outcome),
    /// quota.claim_job(): renew it to this lease (the argument's bytes, an interval's
    /// text in the server encoding, which the pgrx layer reads).
    Claim { lease: Vec<u8> },
}

/// What a job trigger reads, and does, parsed from its arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobTrigger {
    /// The column that holds the ticket (or the JSON document it is in), as its
    /// name's bytes in the server encoding.
    pub column: Vec<u8>,
    /// The JSON keys to follow from the column to the ticket; empty for a uuid or
    /// text column.
    pub keys: Vec<Vec<u8>>,
    pub action: JobAction,
}

impl JobTrigger {
    /// Which function the trigger calls.
    pub fn func(&self) -> JobFn {
        match self.action {
            JobAction::Finish(_) => JobFn::Finish,
            JobAction::Claim { .. } => JobFn::Claim,
        }
    }

    /// The path as written in the trigger's first argument, for messages, each name
    /// shown by `show` (the pgrx layer converts from the server encoding).
    pub fn path(&self, show: impl Fn(&[u8]) -> String) -> String {
        let mut parts = vec![show(&self.column)];
        parts.extend(self.keys.iter().map(|k| show(k)));
        parts.join("->")
    }
}

const ARROW: &[u8] = b"->";

fn split_path(path: &[u8]) -> Vec<&[u8]> {
    let mut parts = Vec::new();
    let mut rest = path;
    while let Some(at) = rest.windows(ARROW.len()).position(|w| w == ARROW) {
        parts.push(&rest[..at]);
        rest = &rest[at + ARROW.len()..];
    }
    parts.push(rest);
    parts
}

/// Parses the arguments of trigger `trigger` (its name, for messages) of `func`: the
/// ticket's path, and finish_job()'s optional outcome or claim_job()'s lease, each as
/// the bytes of the server encoding, which `show` turns into text for messages (the
/// pgrx layer converts from the server encoding).
pub fn parse_job_trigger(
    func: JobFn,
    trigger: &str,
    args: &[&[u8]],
    show: impl Fn(&[u8]) -> String,
) -> Result<JobTrigger, QuotaError> {
    let bad = |why: String| QuotaError::TriggerArguments {
        func,
        trigger: trigger.to_string(),
        why,
    };
    let (path, action) = match (func, args) {
        (JobFn::Finish, [path]) => (*path, JobAction::Finish(Outcome::Succeeded)),
        (JobFn::Finish, [path, outcome]) => (
            *path,
            JobAction::Finish(parse_outcome(outcome).map_err(|_| {
                bad(format!(
                    "The outcome \"{}\" is not succeeded, failed or cancelled.",
                    show(outcome)
                ))
            })?),
        ),
        (JobFn::Claim, [path, lease]) => (
            *path,
            JobAction::Claim {
                lease: lease.to_vec(),
            },
        ),
        _ => {
            return Err(bad(format!(
                "It has {} arguments; {func} takes the ticket's column, and {}.",
                args.len(),
                match func {
                    JobFn::Finish => "an outcome",
                    JobFn::Claim => "the lease",
                }
            )))
        }
    };
    let parts = split_path(path);
    if let Some(i) = parts.iter().position(|p| p.is_empty()) {
        return Err(bad(format!(
            "The path \"{}\" has an empty {} at position {}.",
            show(path),
            if i == 0 { "column name" } else { "key" },
            i + 1
        )));
    }
    Ok(JobTrigger {
        column: parts[0].to_vec(),
        keys: parts[1..].iter().map(|p| p.to_vec()).collect(),
        action,
    })
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// How a trigger fires (or, at CREATE TRIGGER, may fire): for each row or statement,
/// its timing, and the events it fires on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Firing {
    pub row: bool,
    pub before: bool,
    pub instead: bool,
    /// On INSERT or TRUNCATE.
    pub inserts: bool,
    pub updates: bool,
    pub deletes: bool,
}

/// Whether a trigger of `func` may fire so: finish_job() AFTER UPDATE or DELETE (the
/// queue ends the job), claim_job() BEFORE UPDATE only (it changes the claimed row),
/// each FOR EACH ROW. The one rule for CREATE TRIGGER and for each firing.
pub fn fires_as(func: JobFn, how: Firing) -> bool {
    how.row
        && !how.instead
        && !how.inserts
        && match func {
            JobFn::Finish => !how.before && (how.updates || how.deletes),
            JobFn::Claim => how.before && how.updates && !how.deletes,
        }
}

/// Reads a uuid from text as PostgreSQL's `uuid` input does: 32 hex digits, either
/// case, a hyphen allowed after any group of four (but not at the end), the whole
/// optionally in braces. None where PostgreSQL would raise 22P02.
pub fn parse_uuid(text: &[u8]) -> Option<[u8; 16]> {
    let inner = match text {
        [b'{', inner @ .., b'}'] => inner,
        _ => text,
    };
    let mut out = [0u8; 16];
    let mut pos = 0;
    for (i, byte) in out.iter_mut().enumerate() {
        let hi = hex(*inner.get(pos)?)?;
        let lo = hex(*inner.get(pos + 1)?)?;
        *byte = hi << 4 | lo;
        pos += 2;
        if i % 2 == 1 && i < 15 && inner.get(pos) == Some(&b'-') {
            pos += 1;
        }
    }
    (pos == inner.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ticket::printable;
    use crate::core::Sqlstate;

    fn parse(args: &[&str]) -> Result<JobTrigger, QuotaError> {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        parse_job_trigger(JobFn::Finish, "t", &args, printable)
    }

    fn parse_claim(args: &[&str]) -> Result<JobTrigger, QuotaError> {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        parse_job_trigger(JobFn::Claim, "t", &args, printable)
    }

    #[test]
    fn how_each_trigger_may_fire() {
        let row = Firing {
            row: true,
            ..Firing::default()
        };
        let after_update = Firing {
            updates: true,
            ..row
        };
        let before_update = Firing {
            before: true,
            ..after_update
        };
        let after_delete = Firing {
            deletes: true,
            ..row
        };
        assert!(fires_as(JobFn::Finish, after_update));
        assert!(fires_as(JobFn::Finish, after_delete));
        assert!(fires_as(
            JobFn::Finish,
            Firing {
                deletes: true,
                ..after_update
            }
        ));
        assert!(!fires_as(JobFn::Finish, before_update));
        assert!(fires_as(JobFn::Claim, before_update));
        assert!(!fires_as(JobFn::Claim, after_update));
        assert!(!fires_as(
            JobFn::Claim,
            Firing {
                deletes: true,
                ..before_update
            }
        ));
        for func in [JobFn::Finish, JobFn::Claim] {
            assert!(!fires_as(
                func,
                Firing {
                    row: false,
                    ..before_update
                }
            ));
            assert!(!fires_as(
                func,
                Firing {
                    row: false,
                    ..after_update
                }
            ));
            assert!(!fires_as(
                func,
                Firing {
                    inserts: true,
                    ..before_update
                }
            ));
            assert!(!fires_as(
                func,
                Firing {
                    inserts: true,
                    ..after_update
                }
            ));
            assert!(!fires_as(
                func,
                Firing {
                    instead: true,
                    before: false,
                    ..before_update
                }
            ));
        }
    }

    #[test]
    fn a_column_and_the_default_outcome() {
        let t = parse(&["ticket"]).unwrap();
        assert_eq!(
            (t.column.as_slice(), t.keys.len(), &t.action),
            (&b"ticket"[..], 0, &JobAction::Finish(Outcome::Succeeded))
        );
        assert_eq!(t.path(printable), "ticket");
    }

    #[test]
    fn json_keys_and_an_outcome() {
        let t = parse(&["args->job->ticket", "failed"]).unwrap();
        assert_eq!(t.column, b"args");
        assert_eq!(t.keys, vec![b"job".to_vec(), b"ticket".to_vec()]);
        assert_eq!(t.action, JobAction::Finish(Outcome::Failed));
        assert_eq!(t.func(), JobFn::Finish);
        assert_eq!(t.path(printable), "args->job->ticket");
        // Names are taken as written: case and spaces are part of them.
        let t = parse(&["Payload-> ticket"]).unwrap();
        assert_eq!(
            (t.column.as_slice(), t.keys[0].as_slice()),
            (&b"Payload"[..], &b" ticket"[..])
        );
    }

    #[test]
    fn bad_arguments_are_22023() {
        for args in [
            &[][..],
            &["a", "succeeded", "x"][..],
            &[""][..],
            &["args->"][..],
            &["->t"][..],
            &["a->->b"][..],
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.sqlstate(), Sqlstate::InvalidParameterValue, "{args:?}");
            assert!(e.to_string().contains("trigger \"t\""), "{e}");
            assert!(e.detail().is_some() && e.hint().is_some());
        }
        let e = parse(&["a->->b"]).unwrap_err();
        assert!(
            e.detail().unwrap().contains("empty key at position 2"),
            "{:?}",
            e.detail()
        );
        let e = parse(&["ticket", "done"]).unwrap_err();
        assert_eq!(e.sqlstate(), Sqlstate::InvalidParameterValue);
        assert!(
            e.detail().unwrap().contains("\"done\" is not succeeded"),
            "{:?}",
            e.detail()
        );
    }

    #[test]
    fn claim_takes_a_path_and_a_lease() {
        let t = parse_claim(&["args->ticket", "5 minutes"]).unwrap();
        assert_eq!(t.column, b"args");
        assert_eq!(t.keys, vec![b"ticket".to_vec()]);
        assert_eq!(
            t.action,
            JobAction::Claim {
                lease: b"5 minutes".to_vec()
            }
        );
        assert_eq!(t.func(), JobFn::Claim);
        // The lease is required; an outcome is not one of its arguments.
        for args in [
            &["args->ticket"][..],
            &[][..],
            &["a", "1 min", "x"][..],
            &["->t", "1 min"][..],
        ] {
            let e = parse_claim(args).unwrap_err();
            assert_eq!(e.sqlstate(), Sqlstate::InvalidParameterValue, "{args:?}");
            assert!(e.to_string().contains("quota.claim_job()"), "{e}");
            assert!(e.hint().unwrap().contains("lease"), "{:?}", e.hint());
        }
        let e = parse_claim(&["ticket"]).unwrap_err();
        assert!(
            e.detail().unwrap().contains(
                "1 arguments; quota.claim_job() takes the ticket's column, and the lease"
            ),
            "{:?}",
            e.detail()
        );
    }

    #[test]
    fn uuid_text_as_postgresql_reads_it() {
        let want = [
            0xa0, 0xee, 0xbc, 0x99, 0x9c, 0x0b, 0x4e, 0xf8, 0xbb, 0x6d, 0x6b, 0xb9, 0xbd, 0x38,
            0x0a, 0x11,
        ];
        // The forms PostgreSQL's documentation lists for uuid input.
        for ok in [
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
            "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
            "a0eebc999c0b4ef8bb6d6bb9bd380a11",
            "a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11",
            "{a0eebc99-9c0b4ef8-bb6d6bb9-bd380a11}",
        ] {
            assert_eq!(parse_uuid(ok.as_bytes()), Some(want), "{ok}");
        }
        for bad in [
            "",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a111",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11-",
            "-a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "a0e-ebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "a0eebc99--9c0b-4ef8-bb6d-6bb9bd380a11",
            "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            " a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "g0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "42",
        ] {
            assert_eq!(parse_uuid(bad.as_bytes()), None, "{bad}");
        }
    }
}
