//! Binds the mlx-c that scripts/bootstrap-mlx installed and generates a run-time loader for it.
//! Reference: crates.io mlx-sys 0.7.0's build script (bindgen over every `mlx/c/*.h`). Unlike it,
//! nothing is linked: every C function becomes a Rust `extern "C"` wrapper that calls through a
//! table filled by `dlopen`, so a missing library is a clear error instead of a loader abort.

use std::{
    env, fs,
    path::{Path, PathBuf},
};

use quote::{format_ident, quote};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let workspace = manifest.join("../..");
    println!("cargo:rerun-if-env-changed=MLX_PREFIX");
    println!("cargo:rerun-if-changed=src/half_prelude.h");
    let pins_path = workspace.join("mlx.pins");
    println!("cargo:rerun-if-changed={}", pins_path.display());

    let prefix = env::var_os("MLX_PREFIX")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join(".mlx/current/mlx"));
    let include = prefix.join("include");
    let header_dir = include.join("mlx/c");
    if !header_dir.join("mlx.h").exists() {
        panic!(
            "mlx-c headers not found under {}: run scripts/bootstrap-mlx (or `make bootstrap`), \
             or set MLX_PREFIX to a folder with include/mlx/c and lib/libmlxc",
            include.display()
        );
    }
    check_versions(&pins_path, &prefix);
    let pins = fs::read_to_string(&pins_path).unwrap_or_default();
    for key in ["MLX_VERSION", "MLX_C_VERSION"] {
        let value = value_of(&pins, key).unwrap_or_else(|| "unknown".into());
        println!("cargo:rustc-env=MLX_SYS_PINNED_{key}={value}");
    }

    let mut headers: Vec<PathBuf> = fs::read_dir(&header_dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "h"))
        .collect();
    headers.sort();

    let mut builder = bindgen::Builder::default()
        .clang_arg(format!("-I{}", include.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc")
        // Defined in src/lib.rs so every target sees the same Rust types.
        .blocklist_type("float16_t")
        .blocklist_type("bfloat16_t");
    if env::var("CARGO_CFG_TARGET_ARCH").unwrap() != "aarch64" {
        let prelude = manifest.join("src/half_prelude.h");
        builder = builder
            .clang_arg("-include")
            .clang_arg(prelude.display().to_string());
    }
    for header in &headers {
        println!("cargo:rerun-if-changed={}", header.display());
        builder = builder.header(header.display().to_string());
    }
    let bindings = builder
        .generate()
        .expect("bindgen failed on the mlx-c headers");
    let code = with_runtime_loader(&bindings.to_string());

    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    fs::write(out.join("bindings.rs"), code).unwrap();

    let libdir = prefix
        .join("lib")
        .canonicalize()
        .unwrap_or(prefix.join("lib"));
    // The loader's last resort, and what dependents read as DEP_MLX_LIBDIR.
    println!("cargo:rustc-env=MLX_SYS_BUILD_LIBDIR={}", libdir.display());
    println!("cargo:libdir={}", libdir.display());
}

/// Refuses a bootstrap cache that was made for other pins than the ones checked in.
fn check_versions(pins_path: &Path, prefix: &Path) {
    let versions_path = prefix.join("../versions");
    println!("cargo:rerun-if-changed={}", versions_path.display());
    let (Ok(pins), Ok(versions)) = (
        fs::read_to_string(pins_path),
        fs::read_to_string(&versions_path),
    ) else {
        return; // MLX_PREFIX pointing at a hand-made install: trust it.
    };
    for key in ["MLX_VERSION", "MLX_C_VERSION"] {
        let want = value_of(&pins, key);
        let have = value_of(&versions, key);
        if want != have {
            panic!(
                "{} has {key}={have:?} but mlx.pins wants {want:?}: run scripts/bootstrap-mlx",
                versions_path.display()
            );
        }
    }
}

fn value_of(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
        .map(|value| value.trim().to_string())
}

fn is_mlx_symbol(name: &syn::Ident) -> bool {
    let name = name.to_string();
    name.starts_with("mlx_") || name.starts_with("_mlx_")
}

/// Replaces every `extern "C" { fn ... }` declaration with a wrapper of the same name and
/// signature that calls through `MlxApi`, the table `loader::api()` fills from libmlxc.
fn with_runtime_loader(bindings: &str) -> String {
    let file: syn::File = syn::parse_str(bindings).expect("bindgen output must parse");
    let mut items = Vec::new();
    let mut fields = Vec::new();
    let mut loads = Vec::new();
    let mut wrappers = Vec::new();
    let mut system = Vec::new();
    for item in file.items {
        let syn::Item::ForeignMod(foreign) = item else {
            items.push(item);
            continue;
        };
        for foreign_item in foreign.items {
            // Declarations from system headers stay plain externs (libc is always linked).
            let function = match foreign_item {
                syn::ForeignItem::Fn(function) if is_mlx_symbol(&function.sig.ident) => function,
                other => {
                    system.push(other);
                    continue;
                }
            };
            let sig = &function.sig;
            // C varargs cannot be forwarded on stable Rust; mlx-c's only one is the
            // `_mlx_error` formatter, which mlx-rs never calls.
            if sig.variadic.is_some() {
                continue;
            }
            let name = &sig.ident;
            let output = &sig.output;
            let arg_types: Vec<_> = sig
                .inputs
                .iter()
                .map(|arg| match arg {
                    syn::FnArg::Typed(typed) => &typed.ty,
                    syn::FnArg::Receiver(_) => unreachable!(),
                })
                .collect();
            let arg_names: Vec<_> = (0..arg_types.len())
                .map(|index| format_ident!("arg{index}"))
                .collect();
            let attrs: Vec<_> = function
                .attrs
                .iter()
                .filter(|attr| attr.path().is_ident("doc"))
                .collect();
            let symbol = syn::LitByteStr::new(
                format!("{name}\0").as_bytes(),
                proc_macro2::Span::call_site(),
            );
            let name_text = name.to_string();
            fields.push(quote! { #name: unsafe extern "C" fn(#(#arg_types),*) #output, });
            loads.push(quote! {
                #name: *library.get(#symbol).map_err(|_| #name_text)?,
            });
            wrappers.push(quote! {
                #(#attrs)*
                #[inline]
                pub unsafe extern "C" fn #name(#(#arg_names: #arg_types),*) #output {
                    (crate::loader::api().#name)(#(#arg_names),*)
                }
            });
        }
    }
    let tokens = quote! {
        #(#items)*

        extern "C" { #(#system)* }

        /// Every mlx-c function, resolved once from the loaded library.
        pub struct MlxApi { #(#fields)* }

        impl MlxApi {
            /// Resolves every symbol; the error names the first one the library lacks.
            ///
            /// # Safety
            /// `library` must be mlx-c built from the headers these bindings came from.
            pub unsafe fn resolve(library: &libloading::Library) -> Result<Self, &'static str> {
                Ok(Self { #(#loads)* })
            }
        }

        #(#wrappers)*
    };
    tokens.to_string()
}
