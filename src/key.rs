//! [`Key`]: the name of a value in the store.

use std::fmt;

/// A key: an `i32` (MXNet's C `int`) or a string. One store holds keys of one kind only.
///
/// ```
/// use kvstore::Key;
/// assert_eq!(Key::from(3), Key::Int(3));
/// assert_eq!(Key::from("w"), Key::Str("w".into()));
/// assert_eq!(Key::from(3).to_string(), "3");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    /// An integer key.
    Int(i32),
    /// A string key.
    Str(String),
}

/// Which kind of key a store holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    /// Integer keys.
    Int,
    /// String keys.
    Str,
}

impl Key {
    /// Whether this key is an int or a string.
    pub fn kind(&self) -> KeyKind {
        match self {
            Key::Int(_) => KeyKind::Int,
            Key::Str(_) => KeyKind::Str,
        }
    }
}

impl From<i32> for Key {
    fn from(k: i32) -> Key {
        Key::Int(k)
    }
}

impl From<&str> for Key {
    fn from(k: &str) -> Key {
        Key::Str(k.to_owned())
    }
}

impl From<String> for Key {
    fn from(k: String) -> Key {
        Key::Str(k)
    }
}

impl From<&String> for Key {
    fn from(k: &String) -> Key {
        Key::Str(k.clone())
    }
}

impl From<&Key> for Key {
    fn from(k: &Key) -> Key {
        k.clone()
    }
}

impl From<&i32> for Key {
    fn from(k: &i32) -> Key {
        Key::Int(*k)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Int(k) => write!(f, "{k}"),
            Key::Str(k) => f.write_str(k),
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyKind::Int => "int",
            KeyKind::Str => "string",
        })
    }
}
