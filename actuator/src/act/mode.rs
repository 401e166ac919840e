//! The router's migration mode as the actuator drives it, and the operator's holds.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The migration mode, mirroring the fork's `DYN_KV_MIGRATION` (`0` / `dry` / `1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Mode {
    /// `DYN_KV_MIGRATION=0`: no migration logic at all. Only an operator sets it.
    Off,
    /// `DYN_KV_MIGRATION=dry`: spills are logged with what a migration would move; nothing
    /// is migrated. Where the actuator falls back whenever anything is missing or wrong.
    Dry,
    /// `DYN_KV_MIGRATION=1`: spills are migrated.
    Live,
}

impl Mode {
    /// The value of `DYN_KV_MIGRATION` for this mode.
    pub fn dyn_kv_migration(self) -> &'static str {
        match self {
            Mode::Off => "0",
            Mode::Dry => "dry",
            Mode::Live => "1",
        }
    }

    /// Lower-case name (`off`, `dry`, `live`).
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Dry => "dry",
            Mode::Live => "live",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Off => "OFF",
            Mode::Dry => "DRY",
            Mode::Live => "LIVE",
        })
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    /// `off`/`0`, `dry`, `live`/`1` (any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "0" => Ok(Mode::Off),
            "dry" => Ok(Mode::Dry),
            "live" | "1" => Ok(Mode::Live),
            other => Err(format!("{other:?} is not off|dry|live")),
        }
    }
}

/// A mode the operator pinned: the policy keeps evaluating and reporting, but does not
/// move the mode until the operator releases the hold (`auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum OperatorHold {
    Off,
    Dry,
}

impl OperatorHold {
    pub fn mode(self) -> Mode {
        match self {
            OperatorHold::Off => Mode::Off,
            OperatorHold::Dry => Mode::Dry,
        }
    }
}

/// What an operator can ask for: hold OFF, hold DRY, or hand the mode back to the policy
/// (which starts again from DRY).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Override {
    Off,
    Dry,
    Auto,
}

impl Override {
    pub fn hold(self) -> Option<OperatorHold> {
        match self {
            Override::Off => Some(OperatorHold::Off),
            Override::Dry => Some(OperatorHold::Dry),
            Override::Auto => None,
        }
    }
}

impl std::str::FromStr for Override {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "0" => Ok(Override::Off),
            "dry" => Ok(Override::Dry),
            "auto" => Ok(Override::Auto),
            other => Err(format!("{other:?} is not off|dry|auto")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_spell_dyn_kv_migration() {
        assert_eq!(
            [Mode::Off, Mode::Dry, Mode::Live].map(Mode::dyn_kv_migration),
            ["0", "dry", "1"]
        );
        for m in [Mode::Off, Mode::Dry, Mode::Live] {
            assert_eq!(m.dyn_kv_migration().parse::<Mode>().unwrap(), m);
            assert_eq!(m.as_str().parse::<Mode>().unwrap(), m);
        }
        assert!("maybe".parse::<Mode>().is_err());
        assert_eq!(serde_json::to_string(&Mode::Live).unwrap(), "\"LIVE\"");
        assert_eq!("AUTO".parse::<Override>().unwrap(), Override::Auto);
    }
}
