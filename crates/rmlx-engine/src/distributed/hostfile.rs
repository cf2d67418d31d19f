//! rMLX's hostfile: which machines serve one model together and how they talk, turned into the
//! inputs MLX's own backends read (the ring's JSON file, JACCL's device matrix and
//! coordinator). Reference: MLX `distributed/ring/ring.cpp` (`MLX_HOSTFILE`: one list of
//! `ip:port` per rank), `distributed/jaccl` (`MLX_IBV_DEVICES`, `MLX_JACCL_COORDINATOR`),
//! mlx-lm's `mlx.launch` hostfile (which this extends).
//!
//! ```json
//! {"backend": "ring", "port": 32323,
//!  "hosts": [{"ip": "192.168.2.1"}, {"ip": "192.168.2.2"}],
//!  "split": [30, 34]}
//! ```
//! Rank i listens on `port + i` at its own `ip`, never on every interface: the ring has no
//! authentication, so it must only be reachable on the link the cluster uses.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

/// MLX's distributed backends that rMLX runs a pipeline on (both have send and recv; MLX's
/// NCCL has neither, so it cannot carry a pipeline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// TCP sockets to each neighbour (any network: Ethernet, Wi-Fi, a Thunderbolt bridge).
    Ring,
    /// RDMA over Thunderbolt 5 (macOS 26.2 and later, `rdma_ctl enable` in Recovery).
    Jaccl,
}

impl Backend {
    /// The name `mlx_distributed_init` takes.
    pub fn mlx_name(self) -> &'static str {
        match self {
            Self::Ring => "ring",
            Self::Jaccl => "jaccl",
        }
    }
}

/// One machine of the cluster, in rank order.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// Its IPv4 address on the cluster's link (MLX's ring speaks IPv4 only).
    pub ip: Ipv4Addr,
    /// JACCL: its RDMA device towards each rank (`rdma_en3`), null towards itself.
    #[serde(default)]
    pub rdma: Vec<Option<String>>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hostfile {
    pub backend: Backend,
    /// Rank i listens on `port + i` (JACCL: rank 0's coordinator listens on `port`).
    pub port: u16,
    pub hosts: Vec<Host>,
    /// Layers per rank, in rank order (must add up to the model's layers); None: split by the
    /// layers' weight bytes.
    #[serde(default)]
    pub split: Option<Vec<usize>>,
}

/// What is wrong with a hostfile, said so the user can fix it.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum HostfileError {
    #[error("cannot read the hostfile {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("the hostfile {path} is not valid: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl Hostfile {
    /// Reads and checks a hostfile.
    pub fn read(path: &Path) -> Result<Self, HostfileError> {
        let text = std::fs::read_to_string(path).map_err(|error| HostfileError::Read {
            path: path.to_path_buf(),
            message: error.to_string(),
        })?;
        Self::parse(&text).map_err(|message| HostfileError::Invalid {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Parses and checks a hostfile's text; the error says what to change.
    pub fn parse(text: &str) -> Result<Self, String> {
        let hostfile: Hostfile = serde_json::from_str(text).map_err(|error| error.to_string())?;
        hostfile.check()?;
        Ok(hostfile)
    }

    fn check(&self) -> Result<(), String> {
        let size = self.hosts.len();
        if size < 2 {
            return Err(format!(
                "`hosts` lists {size} machine(s): a cluster needs 2 or more"
            ));
        }
        if self.port == 0 || self.port as usize + size - 1 > u16::MAX as usize {
            return Err(format!(
                "`port` {} cannot give ranks 0..{} ports port..port+{} (1-65535)",
                self.port,
                size - 1,
                size - 1
            ));
        }
        for (rank, host) in self.hosts.iter().enumerate() {
            if host.ip.is_unspecified() || host.ip.is_broadcast() || host.ip.is_multicast() {
                return Err(format!(
                    "rank {rank}: `ip` {} is not one machine's address (the ring has no \
                     authentication: each rank listens on its own address on the cluster's link)",
                    host.ip
                ));
            }
        }
        match self.backend {
            Backend::Ring => {
                if let Some(rank) = self.hosts.iter().position(|host| !host.rdma.is_empty()) {
                    return Err(format!(
                        "rank {rank} lists `rdma` devices, which only the jaccl backend uses"
                    ));
                }
            }
            Backend::Jaccl => {
                for (rank, host) in self.hosts.iter().enumerate() {
                    if host.rdma.len() != size {
                        return Err(format!(
                            "rank {rank}: `rdma` needs one entry per rank ({size}), got {}",
                            host.rdma.len()
                        ));
                    }
                    for (peer, device) in host.rdma.iter().enumerate() {
                        match (peer == rank, device) {
                            (true, Some(device)) => {
                                return Err(format!(
                                    "rank {rank}: `rdma[{rank}]` must be null (no device to \
                                     itself), got `{device}`"
                                ))
                            }
                            (false, None) => {
                                return Err(format!(
                                    "rank {rank}: no RDMA device towards rank {peer} (JACCL \
                                     needs a Thunderbolt 5 cable between every pair)"
                                ))
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        if let Some(split) = &self.split {
            if split.len() != size || split.contains(&0) {
                return Err(format!(
                    "`split` needs one layer count of at least 1 per rank ({size}), got {split:?}"
                ));
            }
        }
        Ok(())
    }

    /// Machines in the cluster.
    pub fn size(&self) -> usize {
        self.hosts.len()
    }

    /// Where rank `rank` listens: its own address, `port + rank`.
    pub fn endpoint(&self, rank: usize) -> String {
        format!("{}:{}", self.hosts[rank].ip, self.port as usize + rank)
    }

    /// Rank `rank`'s address for one of rMLX's own links beside MLX's: block 1 the heartbeat
    /// (port + size + rank), block 2 the doorbell (port + 2 × size + rank).
    pub fn rmlx_address(&self, rank: usize, block: usize) -> std::net::SocketAddr {
        let port = self.port as usize + block * self.size() + rank;
        std::net::SocketAddr::from((self.hosts[rank].ip, port as u16))
    }

    /// The ring's hostfile as MLX reads it (`MLX_HOSTFILE`): one list of `ip:port` per rank.
    pub fn ring_json(&self) -> String {
        let ranks: Vec<Vec<String>> = (0..self.size())
            .map(|rank| vec![self.endpoint(rank)])
            .collect();
        serde_json::to_string(&ranks).expect("strings serialize")
    }

    /// JACCL's device matrix (`MLX_IBV_DEVICES`): row i is rank i's device towards each rank.
    pub fn jaccl_devices_json(&self) -> String {
        let matrix: Vec<&Vec<Option<String>>> = self.hosts.iter().map(|host| &host.rdma).collect();
        serde_json::to_string(&matrix).expect("strings serialize")
    }

    /// The environment MLX's backend reads for `rank`, writing the files it names into `dir`:
    /// the ring's JSON (`MLX_HOSTFILE`), or JACCL's device matrix and coordinator.
    pub fn mlx_environment(
        &self,
        rank: usize,
        dir: &Path,
    ) -> std::io::Result<Vec<(&'static str, String)>> {
        let mut env = vec![("MLX_RANK", rank.to_string())];
        std::fs::create_dir_all(dir)?;
        match self.backend {
            Backend::Ring => {
                let path = dir.join(format!("ring-{}-rank{rank}.json", std::process::id()));
                std::fs::write(&path, self.ring_json())?;
                env.push(("MLX_HOSTFILE", path.display().to_string()));
            }
            Backend::Jaccl => {
                let path = dir.join(format!("jaccl-{}-rank{rank}.json", std::process::id()));
                std::fs::write(&path, self.jaccl_devices_json())?;
                env.push(("MLX_IBV_DEVICES", path.display().to_string()));
                env.push((
                    "MLX_JACCL_COORDINATOR",
                    format!("{}:{}", self.hosts[0].ip, self.port),
                ));
            }
        }
        Ok(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Hostfile, String> {
        Hostfile::parse(text)
    }

    #[test]
    fn a_ring_hostfile_gives_each_rank_its_own_address_and_port() {
        let hostfile = parse(
            r#"{"backend": "ring", "port": 40400,
                "hosts": [{"ip": "192.168.2.1"}, {"ip": "192.168.2.2"}, {"ip": "192.168.2.2"}]}"#,
        )
        .unwrap();
        assert_eq!(
            hostfile.ring_json(),
            r#"[["192.168.2.1:40400"],["192.168.2.2:40401"],["192.168.2.2:40402"]]"#
        );
        let dir = std::env::temp_dir().join(format!("rmlx-hostfile-{}", std::process::id()));
        let env = hostfile.mlx_environment(1, &dir).unwrap();
        assert_eq!(env[0], ("MLX_RANK", "1".to_string()));
        assert_eq!(env[1].0, "MLX_HOSTFILE");
        assert_eq!(
            std::fs::read_to_string(&env[1].1).unwrap(),
            hostfile.ring_json()
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_jaccl_hostfile_gives_the_device_matrix_and_the_coordinator() {
        let hostfile = parse(
            r#"{"backend": "jaccl", "port": 5000, "hosts": [
                {"ip": "10.0.0.1", "rdma": [null, "rdma_en3"]},
                {"ip": "10.0.0.2", "rdma": ["rdma_en4", null]}]}"#,
        )
        .unwrap();
        assert_eq!(
            hostfile.jaccl_devices_json(),
            r#"[[null,"rdma_en3"],["rdma_en4",null]]"#
        );
        let dir = std::env::temp_dir().join(format!("rmlx-hostfile-j-{}", std::process::id()));
        let env = hostfile.mlx_environment(0, &dir).unwrap();
        assert!(env.contains(&("MLX_JACCL_COORDINATOR", "10.0.0.1:5000".to_string())));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn bad_hostfiles_are_refused_with_what_to_change() {
        let cases = [
            (
                r#"{"backend": "ring", "port": 1, "hosts": [{"ip": "10.0.0.1"}]}"#,
                "2 or more",
            ),
            (
                r#"{"backend": "ring", "port": 1, "hosts": [{"ip": "0.0.0.0"}, {"ip": "10.0.0.2"}]}"#,
                "no authentication",
            ),
            (
                r#"{"backend": "ring", "port": 65535, "hosts": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]}"#,
                "1-65535",
            ),
            (
                r#"{"backend": "ring", "port": 9, "hosts": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.1"}],
                    "split": [3]}"#,
                "one layer count",
            ),
            (
                r#"{"backend": "nccl", "port": 9, "hosts": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]}"#,
                "unknown variant",
            ),
            (
                r#"{"backend": "jaccl", "port": 9, "hosts": [{"ip": "10.0.0.1", "rdma": [null, null]},
                    {"ip": "10.0.0.2", "rdma": ["rdma_en3", null]}]}"#,
                "towards rank 1",
            ),
            (
                r#"{"backend": "ring", "port": 9, "hosts": [{"ip": "10.0.0.1", "rdma": [null, "x"]},
                    {"ip": "10.0.0.2"}]}"#,
                "only the jaccl backend",
            ),
            (
                r#"{"backend": "ring", "port": 9, "hosts": [{"ip": "fe80::1"}, {"ip": "10.0.0.2"}]}"#,
                "invalid",
            ),
        ];
        for (text, says) in cases {
            let error = parse(text).unwrap_err();
            assert!(error.contains(says), "{text}: {error}");
        }
    }
}
