//! Hiding credentials in what is shown of a configured server: errors and logs (which reach the
//! LLM, the client and the graph) and the config API's answers to readers without its token.

/// Whether `text` (an argument, a flag, a variable's name) names a credential.
pub fn names_secret(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    [
        "token",
        "key",
        "secret",
        "password",
        "passwd",
        "auth",
        "credential",
    ]
    .iter()
    .any(|word| lower.contains(word))
}

/// `url` without its user information, query and fragment. Everything up to the last `@` after
/// the scheme goes (a password may hold an unencoded `?` or `/`), at the cost of a path with an
/// `@` in it losing its host: shown too little, never a password.
///
/// ```
/// use agent_core::redact::without_credentials;
/// assert_eq!(without_credentials("https://u:pw@h:1/p?key=k#f"), "https://h:1/p");
/// assert_eq!(without_credentials("postgres://u:p?x/y@db/app"), "postgres://db/app");
/// assert_eq!(without_credentials("https://h/mcp"), "https://h/mcp");
/// ```
pub fn without_credentials(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let rest = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    match scheme {
        Some(scheme) => format!("{scheme}://{rest}"),
        None => rest.to_owned(),
    }
}

/// What is shown of a stdio server's arguments: an argument that names a secret, or follows a
/// flag that does, is `***`; `NAME=value` whose name does keeps the name; a URL loses its
/// credentials.
///
/// ```
/// use agent_core::redact::shown_arguments;
/// let args = ["--token", "t0k", "--api-key=k", "pkg", "SECRET_X", "pg://u:p@db/x", "--v"];
/// assert_eq!(
///     shown_arguments(&args.map(String::from)),
///     ["--token", "***", "--api-key=***", "pkg", "***", "pg://db/x", "--v"]
/// );
/// ```
pub fn shown_arguments(args: &[String]) -> Vec<String> {
    let mut after_secret_flag = false;
    args.iter()
        .map(|arg| {
            let secret = names_secret(arg);
            let shown = match arg.split_once('=') {
                _ if after_secret_flag => "***".to_owned(),
                Some((flag, _)) if names_secret(flag) => format!("{flag}=***"),
                _ if secret && !arg.starts_with('-') => "***".to_owned(),
                _ if arg.contains("://") => without_credentials(arg),
                _ => arg.clone(),
            };
            after_secret_flag =
                !after_secret_flag && secret && arg.starts_with('-') && !arg.contains('=');
            shown
        })
        .collect()
}
