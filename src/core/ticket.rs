//! Tickets: their ids, labels and outcomes.

use super::errors::QuotaError;

/// Labels are for humans reading `quota.usage` and the ledger; 200 characters is
/// plenty for a job name and keeps a request slot in shared memory small.
pub const MAX_LABEL_CHARS: usize = 200;

/// The longest label in bytes: 200 characters of at most 4 bytes each in UTF-8.
pub const MAX_LABEL_BYTES: usize = MAX_LABEL_CHARS * 4;

pub fn check_label(label: &str) -> Result<(), QuotaError> {
    let chars = label.chars().count();
    if chars > MAX_LABEL_CHARS {
        return Err(QuotaError::LabelTooLong { chars });
    }
    Ok(())
}

/// How a ticket ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
    Cancelled,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// Parses the outcome a caller passes to `finish()`. Matching is exact, as for an enum
/// label in PostgreSQL: `'Succeeded'` is not an outcome.
pub fn parse_outcome(text: &str) -> Result<Outcome, QuotaError> {
    match text {
        "succeeded" => Ok(Outcome::Succeeded),
        "failed" => Ok(Outcome::Failed),
        "cancelled" => Ok(Outcome::Cancelled),
        other => Err(QuotaError::InvalidOutcome(other.to_string())),
    }
}

/// Builds a version 7 UUID (RFC 9562) from a Unix time in milliseconds and 10 random
/// bytes. Ids that grow with time keep the ledger's primary key index append-mostly,
/// which keeps inserts cheap, and they sort in start order.
pub fn uuid_v7(unix_ms: u64, random: [u8; 10]) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&unix_ms.to_be_bytes()[2..]);
    b[6..].copy_from_slice(&random);
    b[6] = (b[6] & 0x0f) | 0x70; // version 7
    b[8] = (b[8] & 0x3f) | 0x80; // RFC 9562 variant
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_of_200_characters_is_accepted() {
        assert!(check_label(&"é".repeat(200)).is_ok());
    }

    #[test]
    fn label_of_201_characters_is_refused_with_22001() {
        let e = check_label(&"x".repeat(201)).unwrap_err();
        assert_eq!(e, QuotaError::LabelTooLong { chars: 201 });
        assert_eq!(e.sqlstate().code(), "22001");
    }

    #[test]
    fn longest_label_fits_in_a_slot() {
        assert!("\u{10FFFF}".repeat(MAX_LABEL_CHARS).len() <= MAX_LABEL_BYTES);
    }

    #[test]
    fn outcomes_round_trip() {
        for o in [Outcome::Succeeded, Outcome::Failed, Outcome::Cancelled] {
            assert_eq!(parse_outcome(o.as_str()).unwrap(), o);
        }
    }

    #[test]
    fn unknown_outcome_is_22023() {
        for bad in ["", "Succeeded", "expired", "done"] {
            let e = parse_outcome(bad).unwrap_err();
            assert_eq!(e.sqlstate().code(), "22023");
        }
    }

    #[test]
    fn uuid_v7_has_version_variant_and_time() {
        let id = uuid_v7(0x0123_4567_89ab, [0xff; 10]);
        assert_eq!(&id[..6], &[0x01, 0x23, 0x45, 0x67, 0x89, 0xab]);
        assert_eq!(id[6] >> 4, 7);
        assert_eq!(id[8] >> 6, 0b10);
    }

    #[test]
    fn uuid_v7_sorts_by_time() {
        assert!(uuid_v7(1000, [0xff; 10]) < uuid_v7(1001, [0; 10]));
    }
}
